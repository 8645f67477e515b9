#!/usr/bin/env bash
# `backstop serve` end to end against the keyed trivial route, side by side in one run:
#   keyed - bench/http.sh's keyed mode: the full server stack, route Keyed on SQLite (FULL,
#           group commit), a trivial handler (the library's cost with nothing behind it)
#   serve - `backstop serve` with its defaults (embedded SQLite store, embedded PSP, the
#           payment handler: intent, PSP charge, outcome), quotas raised for the benchmark
# (STORE=postgres://... runs serve on PostgreSQL instead.) Every request has a new key and order
# (bench/payments.lua). Both run unpinned on both cores with wrk -t2, as a deployment would, in
# ROUNDS interleaved rounds; medians and the ratio serve / keyed are printed, with the number
# of threads serve ran.
# `name value` lines go to OUT (default target/bench-serve.txt) for bench/targets.sh.
# Needs wrk (apt-get install wrk). Usage: bench/serve.sh [SECONDS] [CONNECTIONS] [ROUNDS] [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
secs=${1:-5}
conns=${2:-64}
rounds=${3:-3}
results=${4:-target/bench-serve.txt}
mkdir -p "$(dirname "$results")"
: >"$results"
cargo build --profile profiling -q -p backstop --features postgres --example http_bench_server
cargo build --profile profiling -q -p backstop-cli
dir=$(realpath -m "${CARGO_TARGET_DIR:-target}")/profiling
work=$(mktemp -d)
pid=""
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -rf "$work"' EXIT

stop() {
  stop_pid "$pid"
  pid=""
}

# run MODE ROUND: sets $r (req/s), $p (p99 ms) and $threads.
run() {
  local mode=$1 round=$2 addr log=$work/$1-$2.log
  mkdir -p "$work/$mode-$round"
  if [ "$mode" = keyed ]; then
    "$dir/examples/http_bench_server" keyed "$work/$mode-$round/bench.db" >"$log" 2>&1 &
    pid=$!
    addr=$(wait_addr "$log" 's/^listening on //p')
  else
    (cd "$work/$mode-$round" && exec "$dir/backstop" --log-format json serve \
      --http 127.0.0.1:0 --grpc 127.0.0.1:0 --store "${STORE:-backstop.db}" \
      --tenant-rate 10000000 --tenant-burst 10000000 >"$log" 2>&1) &
    pid=$!
    addr=$(wait_addr "$log" 's/.*"message":"payment service listening".*"http":"\([^"]*\)".*/\1/p')
    addr=${addr#http://}
  fi
  out=$(wrk -t2 -c"$conns" -d"${secs}s" --latency -s bench/payments.lua "http://$addr" -- "$mode$round$$")
  threads=$(ls "/proc/$pid/task" 2>/dev/null | wc -l)
  stop
  wrk_check "mode $mode" "$out"
  r=$(wrk_rps "$out")
  p=$(wrk_p99_ms "$out")
}

declare -A rps p99 thr
for round in $(seq "$rounds"); do
  for mode in keyed serve; do
    run "$mode" "$round"
    echo "round $round $mode: req/s=$r p99_ms=$p threads=$threads" >&2
    rps[$mode]+="$r "
    p99[$mode]+="$p "
    thr[$mode]+="$threads "
  done
done

base=$(median <<<"${rps[keyed]}")
printf '%-6s %10s %9s %8s %14s\n' mode "req/s" "p99 ms" threads "ratio vs keyed"
for mode in keyed serve; do
  r=$(median <<<"${rps[$mode]}")
  printf '%-6s %10.0f %9.2f %8s %14.2f\n' "$mode" "$r" "$(median <<<"${p99[$mode]}")" \
    "$(median <<<"${thr[$mode]}")" "$(echo "$r / $base" | bc -l)"
  echo "${mode}_rps $r" >>"$results"
  echo "${mode}_p99_ms $(median <<<"${p99[$mode]}")" >>"$results"
  echo "${mode}_threads $(median <<<"${thr[$mode]}")" >>"$results"
done
echo "(store ${STORE:-SQLite}; unpinned, wrk -t2 -c$conns -d${secs}s; median of $rounds interleaved rounds)"
