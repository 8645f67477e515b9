#!/usr/bin/env bash
# PostgreSQL claim + complete pairs/s, measured side by side in one run:
#   pgbench    - pgbench -M prepared running the store's two statements
#                (bench/postgres_claim_complete.sql), each in autocommit: the baseline
#   batched    - PostgresStore with its defaults (20 connections, 4 writers): a call runs at once
#                on a free connection; calls that find every connection busy are batched into
#                pipelined transactions
#   matched    - the same with one connection and one writer per caller, as pgbench has
#   autocommit - PostgresStore with group_commit off: one statement, one commit per call,
#                one connection per caller
# at 1, 8 and 32 concurrent callers (CLIENTS), modes interleaved, ROUNDS rounds, medians
# reported. Each side has its own schema holding the same table, emptied before every run.
# Needs pgbench (apt-get install postgresql-contrib) and PostgreSQL on 127.0.0.1:5432.
# Usage: bench/postgres.sh [SECONDS] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-10}
rounds=${2:-3}
clients=${CLIENTS:-1 8 32}
db=${PGDATABASE:-test}
export PGHOST=${PGHOST:-127.0.0.1} PGPORT=${PGPORT:-5432} PGUSER=${PGUSER:-postgres}
export BACKSTOP_BENCH_POSTGRES="postgres://$PGUSER@$PGHOST:$PGPORT/$db"
command -v pgbench >/dev/null || { echo "pgbench not found: apt-get install postgresql-contrib" >&2; exit 1; }

cargo bench -q -p backstop --features postgres --bench postgres_store --no-run 2>/dev/null
psql -q -d "$db" -v ON_ERROR_STOP=1 <<SQL
DROP SCHEMA IF EXISTS bench_pgbench CASCADE;
CREATE SCHEMA bench_pgbench;
SET search_path = bench_pgbench;
$(cat crates/backstop/src/idempotency/postgres/migration_v1.sql)
SQL

run_pgbench() {
  local c=$1
  psql -q -d "$db" -c "TRUNCATE bench_pgbench.idempotency_key; CHECKPOINT" >/dev/null
  PGOPTIONS="-c search_path=bench_pgbench" pgbench -n -M prepared -c "$c" -j "$(( c < 2 ? c : 2 ))" \
    -T "$secs" -f bench/postgres_claim_complete.sql "$db" 2>/dev/null \
    | awk '/^tps = / {printf "%.0f\n", $3}'
}

run_store() {
  local c=$1 mode=$2
  cargo bench -q -p backstop --features postgres --bench postgres_store -- \
    --clients "$c" --seconds "$secs" --mode "$mode" 2>/dev/null \
    | sed -n 's/.*pairs_per_s=\([0-9]*\).*/\1/p'
}

median() { tr ' ' '\n' | grep . | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

echo "PostgreSQL $(psql -d "$db" -Atc 'SHOW server_version'), $(pgbench --version), $(nproc) cores, ${secs}s per run, $rounds rounds"
ratio() { echo "$1 / $2" | bc -l; }
printf '%-8s %9s %9s %9s %10s %9s %9s %9s\n' clients pgbench batched matched autocommit \
  batch/pg match/pg auto/pg
for c in $clients; do
  pg="" bt="" bm="" ac=""
  for _ in $(seq "$rounds"); do
    pg="$pg $(run_pgbench "$c")"
    bt="$bt $(run_store "$c" batched)"
    bm="$bm $(run_store "$c" batched-matched)"
    ac="$ac $(run_store "$c" autocommit)"
  done
  mp=$(median <<<"$pg") mb=$(median <<<"$bt") mm=$(median <<<"$bm") ma=$(median <<<"$ac")
  printf '%-8s %9s %9s %9s %10s %9.2f %9.2f %9.2f   (runs: pgbench%s; batched%s; matched%s; autocommit%s)\n' \
    "$c" "$mp" "$mb" "$mm" "$ma" "$(ratio "$mb" "$mp")" "$(ratio "$mm" "$mp")" "$(ratio "$ma" "$mp")" \
    "$pg" "$bt" "$bm" "$ac"
done
