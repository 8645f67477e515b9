#!/usr/bin/env bash
# What each client layer costs per call, in instructions counted by valgrind's callgrind: the
# in-process client stack built up one layer at a time from the transport (stack_calls
# `client_layers N`), each count the difference of a SMALL and a LARGE run as in
# bench/instructions.sh. Needs valgrind. Usage: bench/client_layers.sh [SMALL] [LARGE]
set -euo pipefail
cd "$(dirname "$0")/.."
small=${1:-2000}
large=${2:-12000}
cargo build --release -q -p backstop --example stack_calls
bin=${CARGO_TARGET_DIR:-target}/release/examples/stack_calls
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# per_call ARGS...: instructions per call of `stack_calls MODE CALLS [LAYERS]`.
per_call() {
  local mode=$1 totals=()
  shift
  for calls in "$small" "$large"; do
    valgrind --tool=callgrind --callgrind-out-file="$work/out" "$bin" "$mode" "$calls" "$@" \
      >/dev/null 2>"$work/log"
    totals+=("$(sed -n 's/^summary: //p' "$work/out")")
  done
  echo $(( (totals[1] - totals[0]) / (large - small) ))
}

names=("transport (request with a deadline)" "+ transparent retry" "+ circuit breaker"
  "+ attempt timeout (grpc-timeout)" "+ hedge (off)" "+ retry (buffered body, head copy)"
  "+ logical deadline" "+ logical request (no key: Safe)")
printf '| layers | instructions per call | this layer |\n|---|---:|---:|\n'
printf '| bare transport, no deadline | %d | |\n' "$(per_call client_bare)"
previous=
for layers in 0 1 2 3 4 5 6 7; do
  count=$(per_call client_layers "$layers")
  printf '| %s | %d | %s |\n' "${names[$layers]}" "$count" "${previous:+$((count - previous))}"
  previous=$count
done
printf '| the client stack (`client_stack`) | %d | |\n' "$(per_call client_stack)"
echo "(callgrind, in process, calls $small vs $large)"
