#!/usr/bin/env bash
# Instructions per loopback RPC (client, server and transport together, one process) of the
# rpc_overhead bench's four modes, counted by valgrind's callgrind: deterministic to a few
# percent, where RPC/s on a shared 2-core machine moves by tens of percent between runs.
# Each mode runs twice, with SMALL and LARGE calls; the difference divided by LARGE - SMALL
# removes start-up costs. Needs valgrind (apt-get install valgrind).
# Usage: [TRANSPORTS="grpc http"] bench/rpc_instructions.sh [SMALL] [LARGE] [CONNS]
set -euo pipefail
cd "$(dirname "$0")/.."
small=${1:-2000}
large=${2:-8000}
conns=${3:-32}
# The profiling profile: release code with line tables, for callgrind_annotate.
bin=$(cargo bench --profile profiling -p backstop-payment --bench rpc_overhead --no-run \
  --message-format=json 2>/dev/null |
  sed -n 's/.*"executable":"\([^"]*rpc_overhead[^"]*\)".*/\1/p' | tail -1)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# instructions TRANSPORT MODE CALLS: total instructions (Ir) of one run.
instructions() {
  valgrind --tool=callgrind --callgrind-out-file="$work/out" "$bin" --only "$1" --mode "$2" \
    --calls "$3" --conns "$conns" --rounds 1 >/dev/null 2>"$work/log"
  sed -n 's/^summary: //p' "$work/out"
}

names=(bare "server stack" "client stack" "both stacks")
printf '| transport | mode | instructions per RPC | ratio to bare |\n|---|---|---:|---:|\n'
for transport in ${TRANSPORTS:-grpc http}; do
  bare=0
  for mode in 0 1 2 3; do
    a=$(instructions "$transport" "$mode" "$small")
    b=$(instructions "$transport" "$mode" "$large")
    per=$(( (b - a) / (large - small) ))
    [ "$mode" = 0 ] && bare=$per
    printf '| %s | %s | %d | %.2f |\n' "$transport" "${names[$mode]}" "$per" \
      "$(echo "$bare / $per" | bc -l)"
  done
done
echo "(callgrind, $conns connections, calls $small vs $large; ratio = bare / mode, the RPC/s"
echo " ratio a CPU-bound run would show)"
