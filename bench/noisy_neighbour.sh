#!/usr/bin/env bash
# Noisy neighbour: `serve --max-inflight 16 --api-key noisy=... --api-key quiet=...` with the
# PSP at 100 ms. The capacity is measured first (merchant noisy, 16 requests in flight, no
# more); then, against a fresh service and store each, merchant noisy offers 3x and 5x that
# rate (`backstop load`, open loop, 2 s deadline) while merchant quiet sends 10 payments a
# second from at most 2 in flight (far below its share), for DURATION. Per run: the quiet
# merchant's payments created, its attempts not answered 201 (refused, failed or timed out;
# lost hedges aside), its p99 (first attempts, client side); the noisy merchant's goodput and
# failures;
# the server's refusals by reason and the connections it pushed away.
# BIN measures that binary instead of building one (a previous commit's, to compare).
# Usage: bench/noisy_neighbour.sh [DURATION] [debug|release]     (default: 20s debug)
set -euo pipefail
cd "$(dirname "$0")/.."
duration=${1:-20s}
profile=${2:-debug}
if [ -n "${BIN:-}" ]; then
  bin=$BIN
elif [ "$profile" = release ]; then
  cargo build -q --release -p backstop-cli
  bin=${CARGO_TARGET_DIR:-target}/release/backstop
else
  cargo build -q -p backstop-cli
  bin=${CARGO_TARGET_DIR:-target}/debug/backstop
fi
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

# Starts a service (store $work/$1.db); sets $serve and $http.
start() {
  "$bin" serve --http 127.0.0.1:0 --grpc 127.0.0.1:0 --store "sqlite://$work/$1.db" \
    --psp "http://$psp" --max-inflight 16 --api-key noisy=key-noisy --api-key quiet=key-quiet \
    --log-format json >"$work/$1.log" 2>&1 &
  serve=$!
  pids+=("$serve")
  for _ in $(seq 50); do grep -q '"http":' "$work/$1.log" && break; sleep 0.2; done
  http=$(grep -o '"http":"[^"]*"' "$work/$1.log" | head -1 | cut -d'"' -f4)
}

start capacity
"$bin" load --target "http://$http" --api-key key-noisy --rate 2000 --concurrency 16 \
  --duration 10s --json >"$work/capacity.json" 2>/dev/null
capacity=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["goodput_per_s"])' "$work/capacity.json")
echo "capacity (16 in flight): $capacity/s"
kill "$serve"

echo "| noisy load | quiet created | quiet attempts not ok | quiet p99 (first attempts) | noisy goodput/s | noisy ok | noisy not ok | server refusals by reason | connections pushed |"
echo "|---|---|---|---|---|---|---|---|---|"
for x in 3 5; do
  start "x$x"
  rate=$(python3 -c "print(round($capacity * $x))")
  "$bin" load --target "http://$http" --api-key key-noisy --rate "$rate" --concurrency 100000 \
    --duration "$duration" --json >"$work/noisy-$x.json" 2>/dev/null &
  noisy=$!
  "$bin" load --target "http://$http" --api-key key-quiet --rate 10 --concurrency 2 \
    --duration "$duration" --json >"$work/quiet-$x.json" 2>/dev/null
  wait "$noisy"
  curl -s "http://$http/metrics" >"$work/x$x.metrics"
  python3 - "$work/quiet-$x.json" "$work/noisy-$x.json" "$work/x$x.metrics" "$x" "$rate" <<'EOF'
import json, re, sys
q = json.load(open(sys.argv[1]))
n = json.load(open(sys.argv[2]))
metrics = open(sys.argv[3]).read()
reasons = {m[1]: int(float(m[2])) for m in re.finditer(r'rpc_server_rejected_total\{.*reason="(\w+)"\} (\S+)', metrics)}
pushed = sum(int(float(m[1])) for m in re.finditer(r'rpc_server_connections_pushed_total\{[^}]*\} (\S+)', metrics))
ok = q["outcomes"].get("ok", 0)
first = q["latency_ms"][0] if q["latency_ms"] else {"count": 0, "p99_ms": float("nan")}
refused = sum(v for k, v in q["attempt_outcomes"].items() if k not in ("ok", "cancelled"))
no = n["outcomes"].get("ok", 0)
others = {k: v for k, v in q["attempt_outcomes"].items() if k not in ("ok", "cancelled")}
print("| %sx (%s/s) | %d / %d (%.1f %%) | %d of %d %s | %.0f ms | %.1f | %d | %d | %s | %d |" % (
    sys.argv[4], sys.argv[5], ok, q["logical_requests"], 100.0 * ok / max(q["logical_requests"], 1),
    refused, q["attempts"], others or "", first["p99_ms"], n["goodput_per_s"], no,
    n["logical_requests"] - no, reasons, pushed))
EOF
  kill "$serve"
done
