#!/usr/bin/env bash
# The Redis token bucket's decisions/s against redis-benchmark running the same script by
# EVALSHA, side by side in one run, against the Redis on 127.0.0.1:6379:
#   redis-benchmark - C client, CONNS connections, no pipelining (-P 1), random tenant keys
#   ours-1          - RedisTokenBucket::check from CONNS concurrent tasks over 1 multiplexed
#                     connection (the default configuration)
#   ours-CONNS      - the same over CONNS multiplexed connections (round robin), the
#                     connection shape of redis-benchmark
# Same script (gcra.lua), same arguments (1000/s, burst 100 per tenant: every decision
# allowed, so each one reads and writes its key), same key shape (KEYSPACE tenants).
# Modes run ROUNDS times, interleaved; medians are reported.
# Usage: bench/redis.sh [TOTAL] [CONNS] [ROUNDS]      (needs redis-tools)
set -euo pipefail
cd "$(dirname "$0")/.."
total=${1:-200000}
conns=${2:-50}
rounds=${3:-3}
keyspace=${KEYSPACE:-10000}
prefix="bench:rl:$$:"
cargo build --release -q -p backstop --features redis --example redis_bucket_bench
bin=${CARGO_TARGET_DIR:-target}/release/examples/redis_bucket_bench
sha=$(redis-cli -h 127.0.0.1 -p 6379 SCRIPT LOAD "$(cat crates/backstop/src/admission/redis/gcra.lua)")

ours() { # CONNECTIONS -> decisions/s
  TOTAL=$total TASKS=$conns CONNECTIONS=$1 KEYSPACE=$keyspace PREFIX="$prefix" "$bin" |
    sed -n 's/.*decisions_per_sec=\([0-9]*\).*/\1/p'
}
theirs() { # -> requests/s
  redis-benchmark -h 127.0.0.1 -p 6379 -c "$conns" -P 1 -n "$total" -r "$keyspace" --csv \
    EVALSHA "$sha" 1 "${prefix}t:__rand_int__" 1000 100000 |
    awk -F'","' 'NR==2 {print int($2)}'
}
median() { sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

: >/tmp/redis-bench.$$
for round in $(seq "$rounds"); do
  echo "redis-benchmark $(theirs)" >>/tmp/redis-bench.$$
  echo "ours-1 $(ours 1)" >>/tmp/redis-bench.$$
  echo "ours-$conns $(ours "$conns")" >>/tmp/redis-bench.$$
done
cat /tmp/redis-bench.$$ >&2
base=$(awk '$1=="redis-benchmark" {print $2}' /tmp/redis-bench.$$ | median)
echo
echo "$(redis-server --version | cut -d' ' -f1-3), $(redis-benchmark --version), $(rustc --version)"
echo "redis crate $(grep -A1 '^name = "redis"$' Cargo.lock | sed -n 's/version = "\(.*\)"/\1/p'); $total decisions per run, $conns concurrent, $rounds rounds, medians"
echo
echo "| client | decisions/s | ratio vs redis-benchmark |"
echo "|---|---:|---:|"
for mode in redis-benchmark ours-1 "ours-$conns"; do
  m=$(awk -v m="$mode" '$1==m {print $2}' /tmp/redis-bench.$$ | median)
  awk -v mode="$mode" -v m="$m" -v b="$base" 'BEGIN {printf "| %s | %d | %.2f |\n", mode, m, m / b}'
done
rm -f /tmp/redis-bench.$$
