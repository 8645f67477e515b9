#!/usr/bin/env bash
# Server CPU per request of one bench/http.sh mode, split by thread: the server runs on core 0
# with one tokio worker, wrk on core 1 for SECONDS; the CPU time each server thread spent on
# CPU (/proc/PID/task/*/schedstat) during the run is divided by the requests wrk completed.
# Steadier than req/s on a shared machine. Usage: bench/server_cpu.sh MODE [SECONDS] [CONNECTIONS]
set -euo pipefail
cd "$(dirname "$0")/.."
mode=$1
secs=${2:-4}
conns=${3:-64}
# The profiling profile: release code with line tables, for perf or callgrind on this binary.
cargo build --profile profiling -q -p backstop --example http_bench_server
bin=${CARGO_TARGET_DIR:-target}/profiling/examples/http_bench_server
work=$(mktemp -d)
TOKIO_WORKER_THREADS=1 taskset -c 0 "$bin" "$mode" "$work/db" >"$work/server.out" 2>&1 &
pid=$!
trap 'kill "$pid" 2>/dev/null; rm -rf "$work"' EXIT
addr=""
for _ in $(seq 100); do
  addr=$(sed -n 's/^listening on //p' "$work/server.out")
  [ -n "$addr" ] && break
  sleep 0.1
done
[ -n "$addr" ] || { echo "server did not start" >&2; cat "$work/server.out" >&2; exit 1; }

# thread_ns: prints "NAME NS" per server thread (time on CPU so far).
thread_ns() { for t in /proc/"$pid"/task/*; do echo "$(cat "$t/comm") $(cut -d' ' -f1 "$t/schedstat")"; done; }
before=$(thread_ns)
out=$(taskset -c 1 wrk -t1 -c"$conns" -d"${secs}s" -s bench/payments.lua "http://$addr" -- "cpu$$")
after=$(thread_ns)
n=$(awk '/requests in/ {print $1}' <<<"$out")
echo "$mode: $n requests, $(awk '/^Requests\/sec/ {print $2}' <<<"$out") req/s; server CPU per request:"
# Threads that started during the run (none expected) count from zero.
awk -v n="$n" 'NR == FNR { b[$1] += $2; next } { a[$1] += $2 }
  END { for (k in a) { t += a[k] - b[k]; printf "  %-20s %8.1f us\n", k, (a[k] - b[k]) / n / 1000 }
        printf "  %-20s %8.1f us\n", "total", t / n / 1000 }' <(echo "$before") <(echo "$after")
