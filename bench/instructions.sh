#!/usr/bin/env bash
# Instructions per call of the in-process client and server stacks against the bare services
# (and of the server stack with an idempotency-keyed route on the in-memory store),
# counted by valgrind's callgrind (deterministic: the same build gives the same count whatever
# else the machine is doing, unlike timings). Each mode runs twice, with SMALL and LARGE calls;
# the difference divided by LARGE - SMALL removes start-up and warm-up costs.
# Needs valgrind (apt-get install valgrind). Usage: bench/instructions.sh [SMALL] [LARGE]
set -euo pipefail
cd "$(dirname "$0")/.."
small=${1:-2000}
large=${2:-12000}
cargo build --release -q -p backstop --example stack_calls
bin=${CARGO_TARGET_DIR:-target}/release/examples/stack_calls
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# instructions MODE CALLS: total instructions (Ir) of one run.
instructions() {
  valgrind --tool=callgrind --callgrind-out-file="$work/out" "$bin" "$1" "$2" >/dev/null 2>"$work/log"
  sed -n 's/^summary: //p' "$work/out"
}

declare -A per_call
for mode in client_bare client_stack server_bare server_stack server_keyed; do
  a=$(instructions "$mode" "$small")
  b=$(instructions "$mode" "$large")
  per_call[$mode]=$(( (b - a) / (large - small) ))
done
printf '%-8s %12s %12s %8s\n' side "bare Ir" "stack Ir" ratio
for side in client server; do
  bare=${per_call[${side}_bare]}
  stack=${per_call[${side}_stack]}
  printf '%-8s %12d %12d %8.2f\n' "$side" "$bare" "$stack" "$(echo "$stack / $bare" | bc -l)"
done
printf '%-8s %12d %12d %8.2f\n' keyed "${per_call[server_bare]}" "${per_call[server_keyed]}" \
  "$(echo "${per_call[server_keyed]} / ${per_call[server_bare]}" | bc -l)"
echo "(instructions per call, callgrind, calls $small vs $large; keyed = the server stack with"
echo " the route keyed on the in-memory store, a fresh key per call)"
