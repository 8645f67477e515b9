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
# Needs wrk (apt-get install wrk). Usage: bench/serve.sh [SECONDS] [CONNECTIONS] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-5}
conns=${2:-64}
rounds=${3:-3}
cargo build --profile profiling -q -p backstop --example http_bench_server
cargo build --profile profiling -q -p backstop-cli
dir=${CARGO_TARGET_DIR:-target}/profiling
work=$(mktemp -d)
pid=""
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -rf "$work"' EXIT

# wait_addr FILE SED: the first address FILE logs, by the sed expression.
wait_addr() {
  for _ in $(seq 200); do
    a=$(sed -n "$2" "$1" 2>/dev/null | head -n1)
    [ -n "$a" ] && { echo "$a"; return; }
    sleep 0.05
  done
  echo "server did not start:" >&2
  cat "$1" >&2
  exit 1
}

stop() {
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 400); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
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
    (cd "$work/$mode-$round" && exec "$OLDPWD/$dir/backstop" --log-format json serve \
      --http 127.0.0.1:0 --grpc 127.0.0.1:0 --store "${STORE:-backstop.db}" \
      --tenant-rate 10000000 --tenant-burst 10000000 >"$log" 2>&1) &
    pid=$!
    addr=$(wait_addr "$log" 's/.*"message":"payment service listening".*"http":"\([^"]*\)".*/\1/p')
    addr=${addr#http://}
  fi
  out=$(wrk -t2 -c"$conns" -d"${secs}s" --latency -s bench/payments.lua "http://$addr" -- "$mode$round$$")
  threads=$(ls "/proc/$pid/task" 2>/dev/null | wc -l)
  stop
  if grep -q "Non-2xx" <<<"$out"; then echo "mode $mode: non-2xx answers" >&2; echo "$out" >&2; exit 1; fi
  r=$(awk '/^Requests\/sec/ {print $2}' <<<"$out")
  p=$(awk '$1=="99%" {v=$2; if (v ~ /us$/) {sub(/us/,"",v); v=v/1000} else if (v ~ /ms$/) {sub(/ms/,"",v)} else if (v ~ /s$/) {sub(/s/,"",v); v=v*1000}; print v}' <<<"$out")
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

median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
base=$(median <<<"${rps[keyed]}")
printf '%-6s %10s %9s %8s %14s\n' mode "req/s" "p99 ms" threads "ratio vs keyed"
for mode in keyed serve; do
  r=$(median <<<"${rps[$mode]}")
  printf '%-6s %10.0f %9.2f %8s %14.2f\n' "$mode" "$r" "$(median <<<"${p99[$mode]}")" \
    "$(median <<<"${thr[$mode]}")" "$(echo "$r / $base" | bc -l)"
done
echo "(store ${STORE:-SQLite}; unpinned, wrk -t2 -c$conns -d${secs}s; median of $rounds interleaved rounds)"
