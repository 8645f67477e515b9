#!/usr/bin/env bash
# Overload: `backstop load` (open loop: no cap on requests in flight; 2 s deadline, backstop client policy) against
# `serve --max-inflight 16` with the PSP at 100 ms, the gate's queue `fifo` (a first-come-
# first-served wait bounded by the deadline) against `fair` (the default). The capacity is
# measured first (16 requests in flight, no more), then 3x and 5x that rate, each against a
# fresh service and store. Per run: goodput, answers, the server-side p99 of served and refused
# requests (upper bound of the histogram bucket), intents left `running` 5 s after the load,
# and the service's peak RSS.
# LIMITS (default "fixed adaptive") and QUEUES (default "fifo fair") choose the gates compared;
# each runs at 1x, 3x and 5x the capacity. After each 3x and 5x run the load drops to 1x for
# 10 s: "recovery" is the end of the first second that served 90 % of it (per-second series).
# Usage: bench/overload.sh [DURATION] [debug|release]     (default: 30s debug)
set -euo pipefail
cd "$(dirname "$0")/.."
duration=${1:-30s}
profile=${2:-debug}
if [ "$profile" = release ]; then
  cargo build -q --release -p backstop-cli
else
  cargo build -q -p backstop-cli
fi
bin=target/$profile/backstop
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

"$bin" psp --listen 127.0.0.1:0 --latency-ms 100 --db "$work/psp.db" --log-format json >"$work/psp.log" 2>&1 &
pids+=($!)
for _ in $(seq 50); do grep -q '"addr":' "$work/psp.log" && break; sleep 0.2; done
psp=$(grep -o '"addr":"[^"]*"' "$work/psp.log" | head -1 | cut -d'"' -f4)

# Starts a service with queue $1 (store $work/$2.db) and limit ${3:-fixed}; sets $serve and
# $http.
start() {
  "$bin" serve --http 127.0.0.1:0 --grpc 127.0.0.1:0 --store "sqlite://$work/$2.db" \
    --psp "http://$psp" --max-inflight 16 --min-inflight 4 --limit "${3:-fixed}" --queue "$1" \
    --log-format json >"$work/$2.log" 2>&1 &
  serve=$!
  pids+=("$serve")
  for _ in $(seq 50); do grep -q '"http":' "$work/$2.log" && break; sleep 0.2; done
  http=$(grep -o '"http":"[^"]*"' "$work/$2.log" | head -1 | cut -d'"' -f4)
}

# Prints one row from the load summary ($1), /metrics and the store ($2); intents are counted
# and the peak RSS read after the recovery run too.
row() {
  sleep 5
  local running rss
  running=$(sqlite3 "$work/$2.db" "SELECT COUNT(*) FROM payment_intent WHERE status = 'running'")
  rss=$(awk '/VmHWM/ {print $2}' "/proc/$serve/status")
  [ -s "$work/$2.metrics" ] || curl -s "http://$http/metrics" >"$work/$2.metrics"
  python3 - "$1" "$work/$2.metrics" "$running" "$rss" <<'EOF'
import json, re, sys
d = json.load(open(sys.argv[1]))
buckets = {}
for line in open(sys.argv[2]):
    m = re.match(r'rpc_server_duration_seconds_bucket\{.*outcome="(\w+)",le="([^"]+)"\} (\S+)', line)
    if m:
        buckets.setdefault(m[1], []).append((float(m[2]), float(m[3])))
def p99(outcome):
    b = sorted(buckets.get(outcome, []))
    if not b or b[-1][1] == 0:
        return "-"
    for le, n in b:
        if n >= 0.99 * b[-1][1]:
            return "<= %g ms" % (le * 1000)
reasons = {m[1]: int(float(m[2])) for m in re.finditer(r'rpc_server_rejected_total\{.*reason="(\w+)"\} (\S+)', open(sys.argv[2]).read())}
o = d["outcomes"]
print("| %.1f | %d | %d | %d | %s | %s | %s | %s | %.0f MiB |" % (
    d["goodput_per_s"], d["logical_requests"], o.get("ok", 0),
    d["logical_requests"] - o.get("ok", 0), reasons, p99("ok"), p99("rejected"),
    sys.argv[3], int(sys.argv[4]) / 1024))
EOF
}

start fair capacity
"$bin" load --target "http://$http" --rate 2000 --concurrency 16 --duration 20s --json \
  >"$work/capacity.json" 2>/dev/null
capacity=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["goodput_per_s"])' "$work/capacity.json")
echo "capacity (16 in flight): $capacity/s"
kill "$serve"
one=$(python3 -c "print(round($capacity))")
echo "| limit | queue | load | goodput/s | sent | ok | not ok | refusals by reason | p99 ok (server) | p99 refused (server) | intents running | peak RSS | recovery |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
for limit in ${LIMITS:-fixed adaptive}; do
  for queue in ${QUEUES:-fifo fair}; do
    for x in 1 3 5; do
      name="$limit-$queue-$x"
      start "$queue" "$name" "$limit"
      rate=$(python3 -c "print(round($capacity * $x))")
      "$bin" load --target "http://$http" --rate "$rate" --concurrency 100000 --duration "$duration" --json \
        >"$work/$name.json" 2>/dev/null
      # The server's view of the overload alone, before the recovery run adds to it.
      curl -s "http://$http/metrics" >"$work/$name.metrics"
      recovery="-"
      if [ "$x" != 1 ]; then
        "$bin" load --target "http://$http" --rate "$one" --concurrency 100000 --duration 10s \
          --series "$work/$name-after.csv" --json >/dev/null 2>&1
        recovery=$(python3 -c '
import csv, sys
rate = float(sys.argv[2])
for row in csv.DictReader(open(sys.argv[1])):
    if int(row["ok"]) >= 0.9 * rate:
        print("%g s" % (float(row["t_s"]) + 1))
        break
else:
    print("> 10 s")
' "$work/$name-after.csv" "$one")
      fi
      printf '| %s | %s | %sx (%s/s) ' "$limit" "$queue" "$x" "$rate"
      row "$work/$name.json" "$name" | sed "s/\$/ $recovery |/"
      kill "$serve"
    done
  done
done
