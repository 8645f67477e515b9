#!/usr/bin/env bash
# HTTP overhead of the backstop server stack, measured side by side in one run:
#   bare  - plain axum, one trivial POST JSON route (the baseline)
#   stack - the same route behind the stack without idempotency
#   keyed - the full stack, route Keyed on SQLite (WAL, synchronous=FULL, group commit)
# (MODES may also name keyed_memory (the in-memory store), keyed_normal (SQLite without the
# fsync on COMMIT: what durability costs) and single layers: deadline metrics rate_limit gate.)
# The server runs on core 0 with one tokio worker, wrk on core 1, so req/s measures the
# server's CPU cost per request. Modes run ROUNDS times, interleaved; medians are reported.
# UNPINNED=1 runs both unpinned instead, as a deployment would: the server with its default
# tokio workers and wrk with two threads share both cores (what the machine as a whole serves).
# Needs wrk (apt-get install wrk). Usage: bench/http.sh [SECONDS] [CONNECTIONS] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
secs=${1:-10}
conns=${2:-64}
rounds=${3:-3}
modes=${MODES:-bare stack keyed}
# The profiling profile: release code with line tables, for perf or callgrind on this binary.
cargo build --profile profiling -q -p backstop --features postgres --example http_bench_server
bin=${CARGO_TARGET_DIR:-target}/profiling/examples/http_bench_server
work=$(mktemp -d)

# Pinned: the server alone on core 0 with one tokio worker, wrk on core 1.
if [ -n "${UNPINNED:-}" ]; then
  run_server=()
  run_wrk=(wrk -t2)
  placement="wrk -t2 and the server unpinned on both cores"
else
  run_server=(env TOKIO_WORKER_THREADS=1 taskset -c 0)
  run_wrk=(taskset -c 1 wrk -t1)
  placement="wrk -t1 on core 1; server on core 0, one tokio worker"
fi

server_pid=""
trap '[ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null; rm -rf "$work"' EXIT

# stop_server: SIGTERM, then wait (at most 10 s) until the server has exited and printed its stats.
stop_server() {
  kill "$server_pid" 2>/dev/null || true
  for _ in $(seq 200); do
    state=$(awk '{print $3}' "/proc/$server_pid/stat" 2>/dev/null || true)
    [ -z "$state" ] || [ "$state" = Z ] && break
    sleep 0.05
  done
}

# run_mode MODE ROUND: sets $r (req/s) and $p (p99 ms).
run_mode() {
  local mode=$1 round=$2 out addr=""
  # The shell truncates the file only once the child runs: remove it first, or the loop below
  # may read the previous server's address.
  rm -f "$work/server.out"
  # Started from a subshell, so the server is not this shell's child: `wait` on it sometimes
  # failed with "wait_for: No record of process" and aborted the run (set -e).
  ("${run_server[@]}" "$bin" "$mode" "$work/$mode-$round.db" >"$work/server.out" 2>&1 &
    echo $! >"$work/server.pid")
  server_pid=$(cat "$work/server.pid")
  for _ in $(seq 100); do
    addr=$(sed -n 's/^listening on //p' "$work/server.out" 2>/dev/null)
    [ -n "$addr" ] && break
    sleep 0.1
  done
  if [ -z "$addr" ]; then echo "mode $mode: server did not start" >&2; cat "$work/server.out" >&2; exit 1; fi
  out=$("${run_wrk[@]}" -c"$conns" -d"${secs}s" --latency -s bench/payments.lua "http://$addr" -- "$mode$round$$")
  stop_server
  server_pid=""
  batches=$(sed -n 's/^sqlite: //p' "$work/server.out")
  if grep -q "Non-2xx" <<<"$out"; then echo "mode $mode: non-2xx answers" >&2; echo "$out" >&2; exit 1; fi
  r=$(wrk_rps "$out")
  p=$(wrk_p99_ms "$out")
}

declare -A rps p99
for round in $(seq "$rounds"); do
  for mode in $modes; do
    run_mode "$mode" "$round"
    echo "round $round $mode: req/s=$r p99_ms=$p${batches:+ (sqlite: $batches)}" >&2
    rps[$mode]+="$r "
    p99[$mode]+="$p "
  done
done

base=$(median <<<"${rps[bare]:-}")
printf '%-10s %10s %9s %14s\n' mode "req/s" "p99 ms" "ratio vs bare"
for mode in $modes; do
  r=$(median <<<"${rps[$mode]}")
  p=$(median <<<"${p99[$mode]}")
  ratio=$( [ -n "$base" ] && echo "$r / $base" | bc -l || echo 0)
  printf '%-10s %10.0f %9.2f %14.2f\n' "$mode" "$r" "$p" "$ratio"
done
echo "($placement; wrk -c$conns -d${secs}s; median of $rounds interleaved rounds)"
