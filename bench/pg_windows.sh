#!/usr/bin/env bash
# Where the PostgreSQL store's windowed claims spend their time, apart from the server stack:
# pgbench runs the store's own claim (backstop_idempotency_claim) and completion statements
# against a schema holding WINDOWS partitions of 1-day keys (the current window and the ones
# before it), each filled with PER records (random keys, as bench/growth.sh fills them).
# The claim is told to skip every sealed window, as an instance whose summaries rule the key
# out does (SUMMARIES=0: none skipped, every window read); the completion names the record's
# window as the store does (pgbench variables: parameters, as the store sends them).
# Prints pgbench's tps for claim + completion, and for the claim alone. -M prepared: plans
# cached per connection, as the store's are.
# Usage: WINDOWS=24 PER=416667 [SUMMARIES=1] bench/pg_windows.sh [SECONDS] [CLIENTS]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-10}
clients=${2:-16}
windows=${WINDOWS:-24}
per=${PER:-0}
pg=${PG:-postgres://postgres@127.0.0.1:5432/test}
schema=bench_pg_windows_$$
url="$pg?options=-c%20search_path%3D$schema"
work=$(mktemp -d)
trap 'psql -q "$pg" -c "DROP SCHEMA IF EXISTS $schema CASCADE" >/dev/null 2>&1; rm -rf "$work"' EXIT
psql -q -v ON_ERROR_STOP=1 "$pg" -c "CREATE SCHEMA $schema" >/dev/null
psql -q -v ON_ERROR_STOP=1 "$url" -f crates/backstop/src/idempotency/postgres/migration_v3.sql >/dev/null
class=86400000
width=3600000
now=$(psql -Atq "$url" -c "SELECT (extract(epoch FROM clock_timestamp()) * 1000)::int8")
index=$(( now / width ))
{
  echo "SET maintenance_work_mem = '1GB';"
  # The current window, the one after it (made ahead, as the store does) and those before.
  for w in $(seq $(( index - windows + 1 )) $(( index + 1 ))); do
    name=idempotency_window_${class}_$w
    echo "CREATE TABLE $name (LIKE idempotency_record INCLUDING DEFAULTS);"
    [ "$per" -gt 0 ] && [ "$w" -le "$index" ] && echo "INSERT INTO $name
      SELECT 'merchant-1', substr(md5(random()::text), 1, 16) || '-fill-' || g,
        md5(random()::text) || md5(random()::text), 'succeeded', 1, 201, '\\x7b7d', '[]', 1,
        9999999999999, NULL, NULL, $class, $w FROM generate_series(1, $per) AS g;"
    echo "ALTER TABLE $name ADD PRIMARY KEY (scope, key),
      ADD CONSTRAINT ${name}_status CHECK (status IN ('running', 'succeeded', 'failed')),
      ADD CONSTRAINT ${name}_bound CHECK (class_ms = $class AND win = $w);
      CREATE INDEX ${name}_expires ON $name (expires_at);
      ALTER TABLE idempotency_record ATTACH PARTITION $name
        FOR VALUES FROM ($class, $w) TO ($class, $(( w + 1 )));"
  done
  echo "VACUUM ANALYZE; CHECKPOINT;"
} | psql -q -v ON_ERROR_STOP=1 "$url" >/dev/null
skip="{}"
if [ "${SUMMARIES:-1}" = 1 ]; then
  skip="{$(for w in $(seq $(( index - windows + 1 )) $(( index - 1 ))); do
    printf 'idempotency_window_%s_%s,' "$class" "$w"; done | sed 's/,$//')}"
fi
cat >"$work/claim.sql" <<SQL
\\set r random(1, 9223372036854775806)
\\set c $class
\\set w $index
SELECT taken FROM backstop_idempotency_claim('merchant-1', :r::text, 'f', 9999999999999, 1, 9999999999999, $class, $width, 0, '$skip');
UPDATE idempotency_record SET status = 'succeeded', http_status = 201, response_body = '\\x7b7d', response_headers = '[]', expires_at = GREATEST(expires_at, 9999999999999) WHERE scope = 'merchant-1' AND key = :r::text AND status = 'running' AND lease_until = 9999999999999 AND class_ms = :c AND win BETWEEN :w AND :w;
SQL
head -4 "$work/claim.sql" >"$work/claim_only.sql"
records=$(psql -Atq "$url" -c "SELECT count(*) FROM idempotency_record")
tps() {
  pgbench -n -M prepared -c "$clients" -j 2 -T "$secs" -f "$1" "$url" 2>/dev/null |
    sed -n 's/^tps = \([0-9.]*\).*/\1/p'
}
echo "windows=$windows records=$records clients=$clients summaries=${SUMMARIES:-1}" \
  "claim+complete_tps=$(tps "$work/claim.sql") claim_tps=$(tps "$work/claim_only.sql")"
