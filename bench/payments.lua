-- wrk script for bench/http.sh: POST /v1/payments with a fresh Idempotency-Key and order per
-- request, so a Keyed route claims and completes a new record every time.
local counter = 0
local threads = 0

function setup(thread)
  thread:set("tid", threads)
  threads = threads + 1
end

function init(args)
  run = args[1] or tostring(os.time())
end

function request()
  counter = counter + 1
  local id = run .. "-" .. tid .. "-" .. counter
  return wrk.format("POST", "/v1/payments", {
    ["Content-Type"] = "application/json",
    ["Idempotency-Key"] = "bench-" .. id,
    ["grpc-timeout"] = "5S",
  }, '{"order_id":"o-' .. id .. '","amount_cents":1999,"currency":"USD"}')
end
