#!/usr/bin/env bash
# What each client and server layer costs per call, in instructions counted by valgrind's
# callgrind: the in-process stacks built up one layer at a time from the transport or the
# handler (stack_calls `client_layers N`, `server_layers N`), each count the difference of a
# SMALL and a LARGE run as in bench/instructions.sh. Needs valgrind.
# Usage: bench/layers.sh [SMALL] [LARGE]
set -euo pipefail
small=${1:-2000}
large=${2:-12000}
# shellcheck source=bench/stack_calls.sh
source "$(dirname "$0")/stack_calls.sh"

# table MODE WHOLE NAMES...: one row per layer count, then the whole stack's own mode.
table() {
  local mode=$1 whole=$2 previous= layers=0 count
  shift 2
  for name in "$@"; do
    count=$(per_call "$mode" "$layers")
    printf '| %s | %d | %s |\n' "$name" "$count" "${previous:+$((count - previous))}"
    previous=$count
    layers=$((layers + 1))
  done
  printf '| the whole stack (`%s`) | %d | |\n' "$whole" "$(per_call "$whole")"
}

printf '| client layers | instructions per call | this layer |\n|---|---:|---:|\n'
printf '| bare transport, no deadline | %d | |\n' "$(per_call client_bare)"
table client_layers client_stack "transport (request with a deadline)" "+ transparent retry" \
  "+ circuit breaker" "+ attempt timeout (grpc-timeout)" "+ hedge (off)" \
  "+ retry (buffered body, head copy)" "+ logical deadline" "+ logical request (no key: Safe)"
echo
printf '| server layers | instructions per call | this layer |\n|---|---:|---:|\n'
table server_layers server_stack "handler" "+ idempotency (route not keyed)" "+ gate" \
  "+ tenant rate limit" "+ tenant (open: no API keys)" "+ metrics" "+ deadline"
echo "(callgrind, in process, calls $small vs $large)"
