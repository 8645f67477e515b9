-- GCRA token bucket for one key, decided atomically inside Redis.
--
-- KEYS[1]  the key's theoretical arrival time (TAT): microseconds on the Redis server's clock
--          at which the bucket is full again. Absent (or expired) means full.
-- ARGV[1]  increment: microseconds one request moves the TAT forward (the quota's interval).
-- ARGV[2]  tolerance: how far ahead of now the TAT may lie (burst x interval, microseconds).
--
-- Returns 0 when the request is allowed, else the wait in microseconds until it would be.
--
-- Time comes from the server (TIME), so the instances' clocks do not matter. A key expires
-- when its bucket is full again: an idle tenant costs nothing.

-- Redis < 5 replicates scripts verbatim and then refuses a write after TIME; from 5 on,
-- effects are replicated and this call is a no-op (deprecated in 7, still present).
if redis.replicate_commands then
  redis.replicate_commands()
end

local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local increment = tonumber(ARGV[1])
local tolerance = tonumber(ARGV[2])

local tat = tonumber(redis.call('GET', KEYS[1]))
if not tat or tat < now then
  tat = now
end
local new_tat = tat + increment
local ahead = new_tat - now
if ahead > tolerance then
  return ahead - tolerance
end
-- '%d', not tostring: Lua prints numbers with 14 significant digits, and a TAT has 16.
redis.call('SET', KEYS[1], string.format('%d', new_tat),
  'PX', string.format('%d', math.ceil(ahead / 1000)))
return 0
