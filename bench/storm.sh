#!/usr/bin/env bash
# Clients that stop a storm, and keep succeeding through random failures; counted, not timed.
# Two services, each sent 1,000 logical Charge calls per client:
#   dead   every answer is a refusal: the shared rate limiter is at a dead Redis and fails
#          closed (503 + Retry-After over HTTP, UNAVAILABLE with pushback over gRPC);
#   flaky  10% of attempts fail at random: `serve --fault-abort-percent 10` (503 problem+json
#          fault_injected / UNAVAILABLE, no pushback) in front of the embedded PSP.
# Clients:
#   backstop load --no-storm-alarm   the retry budget alone (dead only)
#   backstop load                    budget + storm alarm (the default)
#   backstop load --throttle         + client-side adaptive throttling
#   grpcio                           retryPolicy maxAttempts 3, without / with retryThrottling
# Prints attempts per logical call and the share of logical calls that succeeded.
# Usage: bench/storm.sh [dead|flaky ...]   (both by default; needs python3 with grpcio and
# grpcio-tools). Release build: cargo build --release -p backstop-cli.
set -euo pipefail
cd "$(dirname "$0")/.."
scenarios=${*:-dead flaky}
cargo build --release -q -p backstop-cli
bin=${CARGO_TARGET_DIR:-target}/release/backstop
work=$(mktemp -d)
pids=()
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done; rm -rf "$work"' EXIT
python3 -m grpc_tools.protoc -Iproto --python_out="$work" --grpc_python_out="$work" proto/payment/v1/payment.proto

for scenario in $scenarios; do
  case $scenario in
    dead) flags=(--redis redis://127.0.0.1:1 --redis-failure closed); clients=(--no-storm-alarm "" --throttle) ;;
    flaky) flags=(--fault-abort-percent 10); clients=("" --throttle) ;;
    *) echo "unknown scenario $scenario (dead or flaky)" >&2; exit 2 ;;
  esac
  log="$work/serve-$scenario.log"
  "$bin" serve --http 127.0.0.1:0 --grpc 127.0.0.1:0 --store "sqlite://$work/$scenario.db" \
    "${flags[@]}" --log-format json >"$log" 2>&1 &
  pids+=($!)
  for _ in $(seq 100); do grep -qs '"grpc":' "$log" && break; sleep 0.2; done
  http=$(grep -o '"http":"[^"]*"' "$log" | head -1 | cut -d'"' -f4)
  grpc=$(grep -o '"grpc":"[^"]*"' "$log" | head -1 | cut -d'"' -f4)
  echo "== $scenario: serve ${flags[*]}"
  for target in "http://$http" "grpc://$grpc"; do
    for client in "${clients[@]}"; do
      printf '%-6s %s %-16s ' "$scenario" "$target" "${client:-default}"
      # shellcheck disable=SC2086
      "$bin" load --target "$target" --rate 100 --duration 10s --json $client 2>/dev/null |
        python3 -c 'import json,sys; d=json.load(sys.stdin); n=d["logical_requests"]; print("attempts/logical %.3f  ok %d/%d (%.1f%%)" % (d["attempts"]/n, d["outcomes"].get("ok",0), n, 100*d["outcomes"].get("ok",0)/n), d["stop_reasons"], d.get("storm_alarm", ""))'
    done
  done
  for mode in none throttle; do
    printf '%-6s ' "$scenario"
    python3 bench/grpcio_storm.py "$work" "$grpc" "http://$http/metrics" "$mode" "$scenario"
  done
done
