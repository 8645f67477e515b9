#!/usr/bin/env bash
# The performance targets of the payment path, measured side by side in one run, and the
# "targets at a glance" rows of BENCHMARKS.md they give:
#   1. keyed POST through the full stack (SQLite, synchronous=FULL, group commit) against the
#      bare route: pinned at 64 connections, unpinned at 256; the in-memory store pinned;
#   2. the same against what a team would write by hand (axum + rusqlite, Mutex<Connection>,
#      autocommit; FULL and NORMAL), in all three placements;
#   4. client + server stacks against bare, HTTP and gRPC, by RPC/s and CPU per RPC.
# Every ratio comes from one placement's interleaved rounds (bench/http.sh) or one process
# (rpc_overhead), so both figures of a ratio are measured under the same conditions.
# Needs wrk (apt-get install wrk) and bc. Usage: bench/targets.sh [SECONDS] [ROUNDS] [OUT.md]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-5}
rounds=${2:-3}
out=${3:-target/bench-targets.md}
mkdir -p "$(dirname "$out")"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
modes="bare keyed keyed_memory handrolled handrolled_normal"

# run_http NAME CONNS [UNPINNED]: bench/http.sh's table into $work/NAME.
run_http() {
  local name=$1 conns=$2
  echo "== $name: $modes, $conns connections" >&2
  UNPINNED=${3:-} MODES="$modes" bench/http.sh "$secs" "$conns" "$rounds" >"$work/$name"
  cat "$work/$name" >&2
}
run_http pinned64 64
run_http unpinned64 64 1
run_http unpinned256 256 1

echo "== rpc_overhead" >&2
cargo bench -q -p backstop-payment --bench rpc_overhead -- --secs "$secs" --conns 32 \
  --rounds "$rounds" >"$work/rpc" 2>"$work/rpc.err"
cat "$work/rpc" >&2

# rps NAME MODE: the median req/s of MODE in run NAME.
rps() { awk -v m="$2" '$1==m {print $2}' "$work/$1"; }
ratio() { echo "scale=2; $1 / $2" | bc -l; }
# verdict RATIO MIN
verdict() { if [ "$(echo "$1 >= $2" | bc -l)" = 1 ]; then echo met; else echo "**not met**"; fi; }
commit=$(git rev-parse --short HEAD)

{
  echo "| target | figures | ratio | status |"
  echo "|---|---|---:|---|"
  row() { # LABEL NUM DEN MIN
    local r
    r=$(ratio "$2" "$3")
    printf '| %s | %.0f vs %.0f req/s | %sx | %s |\n' "$1" "$2" "$3" "$r" "$(verdict "$r" "$4")"
  }
  row "1: keyed vs bare, pinned 64 (>= 0.28x)" "$(rps pinned64 keyed)" "$(rps pinned64 bare)" 0.28
  row "1: keyed vs bare, unpinned 256 (>= 0.45x)" "$(rps unpinned256 keyed)" "$(rps unpinned256 bare)" 0.45
  row "1: keyed in memory vs bare, pinned 64 (>= 0.65x)" "$(rps pinned64 keyed_memory)" "$(rps pinned64 bare)" 0.65
  for placement in pinned64 unpinned64 unpinned256; do
    row "2: keyed FULL vs hand-rolled FULL, $placement (>= 8x)" \
      "$(rps $placement keyed)" "$(rps $placement handrolled)" 8
    row "2: keyed FULL vs hand-rolled NORMAL, $placement (>= 1.5x)" \
      "$(rps $placement keyed)" "$(rps $placement handrolled_normal)" 1.5
  done
  # rpc_overhead's table: | transport | mode | RPC/s | ratio | round ratio | p99 | CPU | CPU ratio |
  for transport in http grpc; do
    line=$(awk -F'|' -v t="$transport" '$2 ~ t && $3 ~ /both stacks/' "$work/rpc")
    rpcs=$(awk -F'|' '{gsub(/[ ,*]/, "", $4); print $4}' <<<"$line")
    cpu=$(awk -F'|' '{gsub(/[ *]/, "", $9); print $9}' <<<"$line")
    printf '| 4: both stacks vs bare, %s, by CPU per RPC (>= 0.90x) | %s RPC/s | %sx | %s |\n' \
      "$transport" "$rpcs" "$cpu" "$(verdict "$cpu" 0.90)"
  done
  echo
  echo "At \`$commit\`: \`bench/targets.sh $secs $rounds\` (bench/http.sh, ${secs} s x $rounds interleaved rounds per placement; rpc_overhead, 32 callers). Targets 3 and 5 are measured apart (BENCHMARKS.md)."
} | tee "$out"
