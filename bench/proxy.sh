#!/usr/bin/env bash
# `backstop proxy` against nginx as the reverse proxy in front of the same fast upstream, in
# one run, modes interleaved round by round:
#   nginx        - nginx (Debian's package), one worker, keep-alive to the upstream
#   passthrough  - backstop proxy, its fallback `unsafe`: every request passes through (without
#                  it the fallback is `auto` and keys each POST that carries a key)
#   keyed        - backstop proxy, the route keyed on its embedded SQLite store
#                  (WAL, synchronous=FULL): each request claims and completes a new key
# The upstream is the HTTP benchmark's plain axum server (http_bench_server bare: POST
# /v1/payments echoes its JSON, 201), one tokio worker, sharing core 1 with wrk -t1; the proxy
# under test runs alone on core 0 (nginx: worker_processes 1; backstop: one tokio worker), so
# req/s compares what each proxy does with one core. Neither logs each request (nginx
# access_log off, backstop RUST_LOG=warn). Every request carries a fresh Idempotency-Key
# (bench/payments.lua); only the keyed mode acts on it. Medians of ROUNDS rounds.
# With PREVIOUS=COMMIT, a fourth mode `previous` runs COMMIT's `backstop proxy` pass-through
# (built once, bench/lib.sh previous_build) beside this tree's, so a regression shows as a ratio.
# Both builds use the `profiling` profile (release code generation, with line tables).
# Needs nginx and wrk (apt-get install nginx-light wrk).
# Usage: [MODES="..."] [PREVIOUS=COMMIT] bench/proxy.sh [SECONDS] [CONNECTIONS] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
secs=${1:-10}
conns=${2:-64}
rounds=${3:-3}
modes=${MODES:-nginx passthrough keyed}
command -v nginx >/dev/null || { echo "needs nginx (apt-get install nginx-light)" >&2; exit 1; }
command -v wrk >/dev/null || { echo "needs wrk (apt-get install wrk)" >&2; exit 1; }
cargo build --profile profiling -q -p backstop-cli -p backstop --bin backstop \
  --example http_bench_server
target=${CARGO_TARGET_DIR:-target}/profiling
if [ -n "${PREVIOUS:-}" ]; then
  previous=$(git rev-parse --short=7 "$PREVIOUS^{commit}")
  previous_bin=$(previous_build "$previous" backstop -p backstop-cli --bin backstop)
  modes="$modes previous"
fi
work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do stop_pid "$pid"; done
  rm -rf "$work"
}
trap cleanup EXIT

# The upstream, for the whole run.
start_bare_upstream "$target" "$work" taskset -c 1

printf '[[policies.route]]\nmatch = "POST /v1/payments"\nidempotency = "keyed"\n' >"$work/keyed.toml"
printf '[policies.fallback]\nidempotency = "unsafe"\n' >"$work/passthrough.toml"

# start_proxy MODE ROUND: starts the proxy of MODE on core 0; sets $proxy_pid and $addr.
start_proxy() {
  local mode=$1 round=$2
  rm -f "$work/proxy.out"
  case $mode in
    nginx)
      local port
      port=$(free_port)
      nginx_conf "$work/nginx" "$port" "$upstream"
      (taskset -c 0 nginx -p "$work/nginx" -c "$work/nginx/nginx.conf" >"$work/proxy.out" 2>&1 &
        echo $! >"$work/proxy.pid")
      proxy_pid=$(cat "$work/proxy.pid")
      addr=127.0.0.1:$port
      # nginx logs nothing when it listens: wait for the port.
      wait_port "$port"
      ;;
    passthrough | keyed | previous)
      local config=(--config "$work/passthrough.toml") bin=$target/backstop
      [ "$mode" = keyed ] && config=(--config "$work/keyed.toml")
      [ "$mode" = previous ] && bin=$previous_bin
      # The listening line's target: backstop::proxy::server in the previous binary.
      (RUST_LOG=warn,backstop::proxy::server=info,backstop_proxy::server=info TOKIO_WORKER_THREADS=1 taskset -c 0 \
        "$bin" --log-format json proxy --listen 127.0.0.1:0 --admin 127.0.0.1:0 \
        --upstream "http://$upstream" --store "sqlite://$work/$mode-$round.db" "${config[@]}" \
        >"$work/proxy.out" 2>&1 & echo $! >"$work/proxy.pid")
      proxy_pid=$(cat "$work/proxy.pid")
      addr=$(wait_addr "$work/proxy.out" '/proxy listening/s/.*"listen":"\([^"]*\)".*/\1/p')
      ;;
  esac
}

declare -A rps p99
for round in $(seq "$rounds"); do
  for mode in $modes; do
    start_proxy "$mode" "$round"
    out=$(taskset -c 1 wrk -t1 -c"$conns" -d"${secs}s" --latency -s bench/payments.lua \
      "http://$addr" -- "$mode$round$$")
    stop_pid "$proxy_pid"
    wrk_check "$mode" "$out"
    r=$(wrk_rps "$out")
    p=$(wrk_p99_ms "$out")
    echo "round $round $mode: req/s=$r p99_ms=$p" >&2
    rps[$mode]+="$r "
    p99[$mode]+="$p "
  done
done

base=$(median <<<"${rps[nginx]:-}")
pass=$(median <<<"${rps[passthrough]:-}")
printf '%-12s %10s %9s %12s %18s\n' mode "req/s" "p99 ms" "vs nginx" "vs passthrough"
for mode in $modes; do
  r=$(median <<<"${rps[$mode]}")
  p=$(median <<<"${p99[$mode]}")
  printf '%-12s %10.0f %9.2f %12s %18s\n' "$mode" "$r" "$p" \
    "$([ -n "$base" ] && ratio "$r" "$base" || echo -)" \
    "$([ -n "$pass" ] && ratio "$r" "$pass" || echo -)"
done
echo "(proxy alone on core 0; upstream and wrk -t1 on core 1; wrk -c$conns -d${secs}s; median of $rounds interleaved rounds)"
