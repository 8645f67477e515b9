#!/usr/bin/env bash
# Clients against a dependency that refuses everything: a `serve` whose shared rate limiter is
# at a dead Redis and fails closed (every answer 503 + Retry-After / UNAVAILABLE with pushback).
# 1,000 logical Charge calls per client, counted (not timed):
#   backstop load --no-storm-alarm   the retry budget alone
#   backstop load                    budget + storm alarm (the default)
#   backstop load --throttle         + client-side adaptive throttling
#   grpcio                           retryPolicy maxAttempts 3, without / with retryThrottling
# Usage: bench/storm.sh              (needs python3 with grpcio and grpcio-tools)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build -q -p backstop-cli
bin=target/debug/backstop
work=$(mktemp -d)
"$bin" serve --http 127.0.0.1:0 --grpc 127.0.0.1:0 --store "sqlite://$work/b.db" \
  --redis redis://127.0.0.1:1 --redis-failure closed --log-format json >"$work/serve.log" 2>&1 &
serve=$!
trap 'kill $serve; wait $serve 2>/dev/null; rm -rf "$work"' EXIT
for _ in $(seq 50); do grep -q '"grpc":' "$work/serve.log" && break; sleep 0.2; done
http=$(grep -o '"http":"[^"]*"' "$work/serve.log" | head -1 | cut -d'"' -f4)
grpc=$(grep -o '"grpc":"[^"]*"' "$work/serve.log" | head -1 | cut -d'"' -f4)
for target in "http://$http" "grpc://$grpc"; do
  for flags in --no-storm-alarm "" --throttle; do
    printf '%s %-18s ' "$target" "${flags:-default}"
    # shellcheck disable=SC2086
    "$bin" load --target "$target" --rate 100 --duration 10s --json $flags 2>/dev/null |
      python3 -c 'import json,sys; d=json.load(sys.stdin); print("attempts/logical %.3f" % (d["attempts"] / d["logical_requests"]), d["stop_reasons"], d.get("storm_alarm", ""))'
  done
done
python3 -m grpc_tools.protoc -Iproto --python_out="$work" --grpc_python_out="$work" proto/payment/v1/payment.proto
for mode in none throttle; do
  python3 bench/grpcio_storm.py "$work" "$grpc" "http://$http/metrics" "$mode"
done
