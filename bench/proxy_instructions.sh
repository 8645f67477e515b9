#!/usr/bin/env bash
# Instructions per pass-through request of `backstop proxy` and of nginx (one worker, keep-alive
# to the upstream, as bench/proxy.sh configures it) in front of the same upstream, counted by
# valgrind's callgrind: load-independent, where req/s on a shared 2-core machine moves by a
# quarter between rounds. Each proxy runs under callgrind; a warm-up run of wrk is dumped
# apart (start-up, first connections), then WRK_SECS of `wrk -c CONNS -t1` load, dumped alone:
# its instructions divided by the requests wrk counted. The upstream runs natively.
# Leaves each measured profile in OUT (default /tmp/proxy-instructions/) for
# `callgrind_annotate --inclusive=yes`. Needs valgrind, nginx and wrk.
# Usage: [MODES="nginx passthrough"] [OUT=dir] bench/proxy_instructions.sh [WRK_SECS] [CONNS]
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
secs=${1:-20}
conns=${2:-8}
modes=${MODES:-nginx passthrough}
out=${OUT:-${TMPDIR:-/tmp}/proxy-instructions}
mkdir -p "$out"
# The profiling profile: release code with line tables, for callgrind_annotate.
cargo build --profile profiling -q -p backstop-cli -p backstop --bin backstop \
  --example http_bench_server
target=${CARGO_TARGET_DIR:-target}/profiling
work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do stop_pid "$pid"; done
  rm -rf "$work"
}
trap cleanup EXIT

start_bare_upstream "$target" "$work"

printf '| proxy | requests | instructions | instructions per request |\n|---|---:|---:|---:|\n'
for mode in $modes; do
  rm -f "$work"/cg.*
  port=$(free_port)
  case $mode in
    nginx)
      # master_process off: the worker is the process callgrind runs.
      nginx_conf "$work/nginx" "$port" "$upstream" "master_process off;"
      cmd=(nginx -p "$work/nginx" -c "$work/nginx/nginx.conf")
      ;;
    passthrough)
      # Its fallback `unsafe`: every request passes through, its Idempotency-Key too.
      printf '[policies.fallback]\nidempotency = "unsafe"\n' >"$work/passthrough.toml"
      cmd=("$target/backstop" --log-format json proxy --config "$work/passthrough.toml"
        --listen "127.0.0.1:$port" --admin 127.0.0.1:0 --upstream "http://$upstream"
        --store "sqlite://$work/passthrough.db")
      ;;
  esac
  # The environment is set around valgrind itself: a wrapper such as env(1) would exec the
  # proxy outside callgrind.
  (RUST_LOG=warn TOKIO_WORKER_THREADS=1 valgrind --tool=callgrind --callgrind-out-file="$work/cg.%p" "${cmd[@]}" \
    >"$work/proxy.out" 2>&1 & echo $! >"$work/proxy.pid")
  pid=$(cat "$work/proxy.pid")
  wait_port "$port"
  wrk -t1 -c"$conns" -d3s -s bench/payments.lua "http://127.0.0.1:$port" -- "warm$$" >/dev/null
  # Dumping zeroes the counters: the next dump holds the measured load alone.
  callgrind_control -d warm-up "$pid" >/dev/null 2>&1
  result=$(wrk -t1 -c"$conns" -d"${secs}s" -s bench/payments.lua "http://127.0.0.1:$port" \
    -- "$mode$$")
  wrk_check "$mode" "$result"
  callgrind_control -d measured "$pid" >/dev/null 2>&1
  stop_pid "$pid"
  # Parts: .1 warm-up, .2 measured, then the rest until exit.
  profile=$(ls "$work"/cg.*.2)
  cp "$profile" "$out/$mode.callgrind"
  instr=$(sed -n 's/^summary: //p' "$profile")
  [ -n "$instr" ] || instr=$(sed -n 's/^totals: //p' "$profile")
  requests=$(wrk_requests "$result")
  printf '| %s | %d | %d | %d |\n' "$mode" "$requests" "$instr" $((instr / requests))
done
echo "(callgrind; wrk -t1 -c$conns -d${secs}s after a 3 s warm-up dumped apart; upstream native)"
