-- bench/payments.lua with a pause before each request of a connection, for a load below
-- capacity: with N connections and a pause of P ms, wrk offers about N / (P + latency)
-- requests per second. Arguments (after `--`): RUN, `random` or `-`, and the pause in ms.
dofile("bench/payments.lua")
local unpaced_init = init
local pause = 0

function init(args)
  unpaced_init(args)
  pause = tonumber(args[3]) or 0
end

function delay()
  return pause
end
