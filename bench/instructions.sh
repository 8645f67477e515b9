#!/usr/bin/env bash
# Instructions per call of the in-process client and server stacks against the bare services
# (and of the server stack with an idempotency-keyed route on the in-memory store),
# counted by valgrind's callgrind (deterministic: the same build gives the same count whatever
# else the machine is doing, unlike timings). Each mode runs twice, with SMALL and LARGE calls;
# the difference divided by LARGE - SMALL removes start-up and warm-up costs.
# Needs valgrind (apt-get install valgrind). Usage: bench/instructions.sh [SMALL] [LARGE]
set -euo pipefail
small=${1:-2000}
large=${2:-12000}
# shellcheck source=bench/stack_calls.sh
source "$(dirname "$0")/stack_calls.sh"

declare -A count
for mode in client_bare client_stack server_bare server_stack server_keyed; do
  count[$mode]=$(per_call "$mode")
done
printf '%-8s %12s %12s %8s\n' side "bare Ir" "stack Ir" ratio
for side in client server; do
  bare=${count[${side}_bare]}
  stack=${count[${side}_stack]}
  printf '%-8s %12d %12d %8.2f\n' "$side" "$bare" "$stack" "$(echo "$stack / $bare" | bc -l)"
done
printf '%-8s %12d %12d %8.2f\n' keyed "${count[server_bare]}" "${count[server_keyed]}" \
  "$(echo "${count[server_keyed]} / ${count[server_bare]}" | bc -l)"
echo "(instructions per call, callgrind, calls $small vs $large; keyed = the server stack with"
echo " the route keyed on the in-memory store, a fresh key per call)"
