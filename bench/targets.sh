#!/usr/bin/env bash
# The performance targets of the payment path, measured side by side in one run, and the
# "targets at a glance" rows of BENCHMARKS.md they give:
#   1. keyed POST through the full stack (SQLite, synchronous=FULL, group commit) against the
#      bare route: pinned at 64 connections, unpinned at 256; the in-memory store pinned;
#   2. the same against what a team would write by hand (axum + rusqlite, Mutex<Connection>,
#      autocommit; FULL and NORMAL), in all three placements;
#   3. `backstop serve` end to end against the keyed trivial route, on SQLite and on PostgreSQL
#      (bench/serve.sh);
#   4. client + server stacks against bare, HTTP and gRPC, by RPC/s and CPU per RPC;
#   5. how cost grows with work: 10 million live records, a sweep of 1 million while serving at
#      half capacity, RSS after 1 million payments (bench/growth.sh);
#   commits: durable commits per payment of `backstop serve`, counted from outside: fsyncs on
#      SQLite (strace), WAL flushes on PostgreSQL (pg_stat_wal.wal_sync), 200 sequential
#      payments each (bench/commits.sh; COMMITS_PAYMENTS=N for another count);
#   previous: the keyed route's server CPU per request and req/s against a previous commit's
#      binary, pinned and unpinned (bench/previous.sh; PREVIOUS=COMMIT, default 7481e65).
# Every ratio comes from one placement's interleaved rounds (bench/http.sh, serve.sh,
# growth.sh) or one process (rpc_overhead), so both figures of a ratio are measured under the
# same conditions. The table is written to OUT.md and, between its markers, into the "targets
# at a glance" of BENCHMARKS.md (WRITE=0 leaves BENCHMARKS.md alone). About 50 minutes with the
# defaults; PARTS="http rpc serve growth commits previous" picks parts (commits and previous
# only when named), PG=none skips PostgreSQL.
# Needs wrk, bc, sqlite3, psql, strace (apt-get install wrk bc sqlite3 postgresql-client strace) and
# PostgreSQL on 127.0.0.1:5432 (PG=URL for another).
# Usage: bench/targets.sh [SECONDS] [ROUNDS] [OUT.md]
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
secs=${1:-5}
rounds=${2:-3}
out=${3:-target/bench-targets.md}
parts=${PARTS:-http rpc serve growth}
pg=${PG:-postgres://postgres@127.0.0.1:5432/test}
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
has() { [[ " $parts " == *" $1 "* ]]; }
if has http; then
  run_http pinned64 64
  run_http unpinned64 64 1
  run_http unpinned256 256 1
fi
if has rpc; then
  echo "== rpc_overhead" >&2
  cargo bench -q -p backstop-payment --bench rpc_overhead -- --secs "$secs" --conns 32 \
    --rounds "$rounds" >"$work/rpc" 2>"$work/rpc.err"
  cat "$work/rpc" >&2
fi
if has serve; then
  echo "== serve, SQLite" >&2
  bench/serve.sh "$secs" 64 "$rounds" "$work/serve-sqlite" >&2
  if [ "$pg" != none ]; then
    echo "== serve, PostgreSQL" >&2
    psql -q -v ON_ERROR_STOP=1 "$pg" -c "DROP SCHEMA IF EXISTS bench_serve CASCADE" \
      -c "CREATE SCHEMA bench_serve" >/dev/null 2>&1
    STORE="$pg?options=-c%20search_path%3Dbench_serve" bench/serve.sh "$secs" 64 "$rounds" \
      "$work/serve-pg" >&2
    psql -q "$pg" -c "DROP SCHEMA bench_serve CASCADE" >/dev/null 2>&1
  fi
fi
if has growth; then
  echo "== growth" >&2
  PG=$pg bench/growth.sh "$secs" "$rounds" "$work/growth" >&2
fi
if has commits; then
  echo "== commits" >&2
  PG=$pg bench/commits.sh "${COMMITS_PAYMENTS:-200}" "$work/commits" >&2
fi
if has previous; then
  echo "== previous" >&2
  bench/previous.sh "${PREVIOUS:-7481e65}" "$secs" "$rounds" "$work/previous" >&2
fi

# rps NAME MODE: the median req/s of MODE in run NAME.
rps() { awk -v m="$2" '$1==m {print $2}' "$work/$1"; }
# val FILE NAME: NAME's value in a `name value` file of $work.
val() { awk -v k="$2" '$1==k {print $2}' "$work/$1" 2>/dev/null; }
# verdict RATIO MIN (at least) / verdict_max RATIO MAX (at most)
verdict() { if [ "$(echo "$1 >= $2" | bc -l)" = 1 ]; then echo met; else echo "**not met**"; fi; }
verdict_max() { if [ "$(echo "$1 <= $2" | bc -l)" = 1 ]; then echo met; else echo "**not met**"; fi; }
commit=$(git rev-parse --short HEAD)

{
  echo "| target | figures | ratio | status |"
  echo "|---|---|---:|---|"
  row() { # LABEL NUM DEN MIN
    local r
    r=$(ratio "$2" "$3")
    printf '| %s | %.0f vs %.0f req/s | %sx | %s |\n' "$1" "$2" "$3" "$r" "$(verdict "$r" "$4")"
  }
  if has http; then
    row "1: keyed vs bare, pinned 64 (>= 0.28x)" "$(rps pinned64 keyed)" "$(rps pinned64 bare)" 0.28
    row "1: keyed vs bare, unpinned 256 (>= 0.45x)" "$(rps unpinned256 keyed)" "$(rps unpinned256 bare)" 0.45
    row "1: keyed in memory vs bare, pinned 64 (>= 0.65x)" "$(rps pinned64 keyed_memory)" "$(rps pinned64 bare)" 0.65
    for placement in pinned64 unpinned64 unpinned256; do
      row "2: keyed FULL vs hand-rolled FULL, $placement (>= 8x)" \
        "$(rps $placement keyed)" "$(rps $placement handrolled)" 8
      row "2: keyed FULL vs hand-rolled NORMAL, $placement (>= 1.5x)" \
        "$(rps $placement keyed)" "$(rps $placement handrolled_normal)" 1.5
    done
  fi
  if has serve; then
    row "3: serve vs keyed trivial route, SQLite (>= 0.25x; $(val serve-sqlite serve_threads) threads)" \
      "$(val serve-sqlite serve_rps)" "$(val serve-sqlite keyed_rps)" 0.25
    if [ -n "$(val serve-pg serve_rps)" ]; then
      row "3: serve on PostgreSQL vs keyed trivial route (>= 0.12x; $(val serve-pg serve_threads) threads)" \
        "$(val serve-pg serve_rps)" "$(val serve-pg keyed_rps)" 0.12
    fi
  fi
  if has rpc; then
    # rpc_overhead's table: | transport | mode | RPC/s | ratio | round ratio | p99 | CPU | CPU ratio |
    for transport in http grpc; do
      line=$(awk -F'|' -v t="$transport" '$2 ~ t && $3 ~ /both stacks/' "$work/rpc")
      rpcs=$(awk -F'|' '{gsub(/[ ,*]/, "", $4); print $4}' <<<"$line")
      cpu=$(awk -F'|' '{gsub(/[ *]/, "", $9); print $9}' <<<"$line")
      printf '| 4: both stacks vs bare, %s, by CPU per RPC (>= 0.90x) | %s RPC/s | %sx | %s |\n' \
        "$transport" "$rpcs" "$cpu" "$(verdict "$cpu" 0.90)"
    done
  fi
  if has growth; then
    for s in sqlite pg; do
      full=$(val growth "records_${s}_full_rps")
      [ -n "$full" ] || continue
      row "5: keyed with $(val growth records_count) live records vs empty, $s (>= 0.8x)" \
        "$full" "$(val growth "records_${s}_empty_rps")" 0.8
    done
    sweeping=$(val growth sweep_p99_sweeping_ms)
    unexpired=$(val growth sweep_p99_unexpired_ms)
    r=$(ratio "$sweeping" "$unexpired")
    printf '| 5: serve p99 at %s/s (half capacity) while sweeping %s records (<= 2x) | %s vs %s ms | %sx | %s |\n' \
      "$(val growth sweep_rate)" "$(val growth sweep_records)" "$sweeping" "$unexpired" "$r" \
      "$(verdict_max "$r" 2)"
    after=$(val growth rss_after_payments_kib)
    before=$(val growth rss_after_10k_kib)
    r=$(ratio "$after" "$before")
    printf '| 5: serve RSS after %s payments vs after 10k (<= 2x) | %s vs %s KiB | %sx | %s |\n' \
      "$(val growth rss_payments)" "$after" "$before" "$r" "$(verdict_max "$r" 2)"
  fi
  if has commits; then
    v=$(val commits sqlite_syncs_per_payment)
    printf '| durable commits per payment, SQLite fsyncs (<= 2) | %s syncs / %s payments (WAL %s, other %s) | %s | %s |\n' \
      "$(val commits sqlite_syncs)" "$(val commits sqlite_payments)" "$(val commits sqlite_wal_syncs)" \
      "$(val commits sqlite_other_syncs)" "$v" "$(verdict_max "$v" 2)"
    v=$(val commits pg_wal_syncs_per_payment)
    if [ -n "$v" ]; then
      printf '| durable commits per payment, PostgreSQL WAL flushes (<= 2) | %s flushes / %s payments (a start and stop alone: %s) | %s | %s |\n' \
        "$(val commits pg_wal_syncs)" "$(val commits pg_payments)" "$(val commits pg_wal_syncs_start_stop)" \
        "$v" "$(verdict_max "$v" 2)"
    fi
  fi
  if has previous; then
    prev=$(val previous previous_commit)
    for placement in pinned unpinned; do
      conns=64
      [ $placement = unpinned ] && conns=256
      c_old=$(val previous "${placement}_old_cpu_us") c_new=$(val previous "${placement}_new_cpu_us")
      r=$(ratio "$c_new" "$c_old")
      printf '| keyed CPU per request vs %s, %s %s (<= 1.00x) | %s vs %s us (%.0f vs %.0f req/s) | %sx | %s |\n' \
        "$prev" "$placement" "$conns" "$c_new" "$c_old" "$(val previous "${placement}_new_rps")" \
        "$(val previous "${placement}_old_rps")" "$r" "$(verdict_max "$r" 1)"
    done
  fi
  echo
  echo "At \`$commit\`, $(date -u +%Y-%m-%d): \`bench/targets.sh $secs $rounds\` (parts: $parts; ${secs} s x $rounds interleaved rounds per comparison$(has rpc && echo "; rpc_overhead with 32 callers"))."
} | tee "$out"

# The table between the markers of BENCHMARKS.md's "targets at a glance".
if [ "${WRITE:-1}" = 1 ]; then
  begin="<!-- bench/targets.sh writes the table below -->"
  end="<!-- end of bench/targets.sh table -->"
  grep -qF "$begin" BENCHMARKS.md || { echo "BENCHMARKS.md has no '$begin' marker" >&2; exit 1; }
  awk -v f="$out" -v b="$begin" -v e="$end" '
    $0 == b { print; while ((getline l < f) > 0) print l; skip = 1; next }
    $0 == e { skip = 0 }
    !skip { print }' BENCHMARKS.md >"$work/benchmarks.md"
  cp "$work/benchmarks.md" BENCHMARKS.md
  echo "BENCHMARKS.md: targets at a glance updated" >&2
fi
