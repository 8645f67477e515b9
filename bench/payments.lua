-- wrk script for bench/http.sh: POST /v1/payments with a fresh Idempotency-Key and order per
-- request, so a Keyed route claims and completes a new record every time.
-- Arguments (after `--`): RUN (makes keys unique across runs) and, optionally, `random`: keys
-- then start with 16 random hex digits, as client-made UUIDs do, so each new record lands at a
-- random place in the key index instead of next to the previous one.
local counter = 0
local threads = 0

function setup(thread)
  thread:set("tid", threads)
  threads = threads + 1
end

function init(args)
  run = args[1] or tostring(os.time())
  random_keys = args[2] == "random"
  math.randomseed(os.time() * 1000 + tid)
end

function request()
  counter = counter + 1
  local id = run .. "-" .. tid .. "-" .. counter
  local key = "bench-" .. id
  if random_keys then
    key = string.format("%08x%08x-%s", math.random(0, 0x7fffffff), math.random(0, 0x7fffffff), id)
  end
  return wrk.format("POST", "/v1/payments", {
    ["Content-Type"] = "application/json",
    ["Idempotency-Key"] = key,
    ["grpc-timeout"] = "5S",
  }, '{"order_id":"o-' .. id .. '","amount_cents":1999,"currency":"USD"}')
end
