#!/usr/bin/env bash
# How cost grows with work, each comparison side by side in one run:
#   records - keyed POST (bench/http.sh's keyed mode: the full server stack, a trivial handler)
#             on a store already holding RECORDS (10 million) live idempotency records, against
#             an empty one; they are spread over the 24 time windows of their TTL class (tables
#             on SQLite, partitions on PostgreSQL), as a store that has taken records for a
#             whole TTL keeps them; on SQLite (FULL, group commit) and on PostgreSQL (the store's
#             defaults). Keys are random, as client-made UUIDs are, in the filled records and in
#             the new ones, so every claim lands at a random place in the key index. Unpinned,
#             wrk -t2 -c64, ROUNDS interleaved rounds, medians.
#   sweep   - `backstop serve` (SQLite; SWEEP_STORE=postgres: PostgreSQL, each run in a schema
#             of its own, results named sweep_pg_*) at half its capacity while its sweeper expires EXPIRED
#             (1 million) records, held in the three windows before the current one, against the same service holding the same records
#             unexpired: the p99 of the payments in each. Capacity is wrk's closed-loop rate
#             (64 connections) in this run; half of it is offered by wrk with 64 connections
#             that pause between requests (bench/payments_paced.lua), as cheap a load as
#             wrk's (an open-loop driver in the client stack would take CPU from the service).
#   rss     - RSS of `backstop serve` (SQLite) after 10 thousand payments and after PAYMENTS
#             (1 million), in one process.
# PARTS picks the parts (default "records sweep rss"); PG is the PostgreSQL database the records
# part uses (default postgres://postgres@127.0.0.1:5432/test; PG=none skips it). Prints a table
# and writes `name value` lines to OUT (default target/bench-growth.txt) for bench/targets.sh.
# SQLITE_MODES lists the SQLite modes of http_bench_server the records part runs (default keyed;
# empty: PostgreSQL only).
# Needs wrk, sqlite3 and psql (apt-get install wrk sqlite3 postgresql-client).
# Usage: bench/growth.sh [SECONDS] [ROUNDS] [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
secs=${1:-5}
rounds=${2:-3}
out=${3:-target/bench-growth.txt}
parts=${PARTS:-records sweep rss}
records=${RECORDS:-10000000}
expired=${EXPIRED:-1000000}
payments=${PAYMENTS:-1000000}
sweep_secs=${SWEEP_SECS:-60}
pg=${PG:-postgres://postgres@127.0.0.1:5432/test}
# SQLite modes of http_bench_server the records part compares (e.g. "keyed keyed_inline").
sqlite_modes=${SQLITE_MODES-keyed}
for tool in wrk sqlite3 psql bc python3; do
  command -v "$tool" >/dev/null || { echo "$tool not found" >&2; exit 1; }
done
cargo build --profile profiling -q -p backstop --features postgres --example http_bench_server
cargo build --profile profiling -q -p backstop-cli
dir=$(realpath "${CARGO_TARGET_DIR:-target}")/profiling
mkdir -p "$(dirname "$out")"
: >"$out"
work=$(mktemp -d "${TMPDIR:-/tmp}/backstop-growth.XXXXXX")
pid=""
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -rf "$work"' EXIT
now_ms() { date +%s%3N; }
result() { echo "$1 $2" >>"$out"; echo "  $1 = $2" >&2; }

# start_keyed MODE DB: the bench server; sets $pid and $addr.
start_keyed() {
  local log=$work/keyed.log
  rm -f "$log"
  ("$dir/examples/http_bench_server" "$1" "$2" >"$log" 2>&1 & echo $! >"$work/pid")
  pid=$(cat "$work/pid")
  addr=$(wait_addr "$log" 's/^listening on //p')
}

# start_serve DIR FLAGS...: `backstop serve` in DIR (store DIR/backstop.db); sets $pid, $addr.
start_serve() {
  local d=$1
  shift
  mkdir -p "$d"
  rm -f "$d/serve.log"
  (cd "$d" && exec "$dir/backstop" --log-format json serve --http 127.0.0.1:0 \
    --grpc 127.0.0.1:0 --store "${serve_store:-backstop.db}" --tenant-rate 10000000 --tenant-burst 10000000 \
    "$@" >serve.log 2>&1 & echo $! >"$work/pid")
  pid=$(cat "$work/pid")
  addr=$(wait_addr "$d/serve.log" 's/.*"message":"payment service listening".*"http":"\([^"]*\)".*/\1/p')
  addr=${addr#http://}
}

stop() { stop_pid "$pid"; pid=""; }

# template: one real payment with the key `template`, whose record the fills copy.
template() {
  curl -sf -o /dev/null -X POST "http://$addr/v1/payments" -H 'Content-Type: application/json' \
    -H 'Idempotency-Key: template' -H 'grpc-timeout: 5S' \
    -d '{"order_id":"o-template","amount_cents":1999,"currency":"USD"}'
}

# fill_sqlite DB N EXPIRES OFFSETS: N copies of the template record under random keys, spread
# evenly over the time windows OFFSETS (0: the template's own window, 1: the one before, ...),
# as a store that has been taking records for that long keeps them; in transactions of at most
# 500k records, expiring at EXPIRES (unix ms; `keep` keeps the template's). Each window's table
# is made with the template window's own DDL, read back from sqlite_master.
fill_sqlite() {
  local db=$1 n=$2 expires=$3 offsets=$4 chunk=500000 c=0
  [ "$expires" = keep ] && expires=t.expires_at
  local tmpl
  tmpl=$(sqlite3 "$db" "SELECT name FROM sqlite_master WHERE type = 'table' AND name LIKE 'idempotency_window_%'")
  [ "$(wc -w <<<"$tmpl")" = 1 ] || { echo "fill of $db: expected one window, found: $tmpl" >&2; exit 1; }
  local class=${tmpl#idempotency_window_} index=${tmpl##*_}
  class=${class%_*}
  local ddl
  ddl=$(sqlite3 "$db" "SELECT group_concat(sql, '; ') FROM sqlite_master WHERE tbl_name = '$tmpl' AND sql IS NOT NULL")
  local count per
  count=$(wc -w <<<"$offsets")
  per=$(( n / count ))
  {
    echo "PRAGMA cache_size=-4000000; PRAGMA synchronous=OFF;"
    for off in $offsets; do
      local name=idempotency_window_${class}_$(( index - off )) done=0
      # The first window takes the remainder, so the windows hold N in all.
      [ "$off" = "${offsets%%[[:space:]]*}" ] && per=$(( n - n / count * (count - 1) )) || per=$(( n / count ))
      [ "$off" = 0 ] || echo "${ddl//$tmpl/$name};"
      while [ "$done" -lt "$per" ]; do
        local k=$(( per - done < chunk ? per - done : chunk ))
        echo "WITH RECURSIVE s(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM s WHERE i < $k)
          INSERT INTO $name (scope, key, fingerprint, status, lease_until, http_status,
            response_body, response_headers, created_at, expires_at)
          SELECT t.scope, lower(hex(randomblob(8))) || '-fill-$c-' || s.i,
            lower(hex(randomblob(length(t.fingerprint) / 2))), t.status, t.lease_until,
            t.http_status, t.response_body, t.response_headers, t.created_at, $expires
          FROM s, (SELECT * FROM $tmpl WHERE key = 'template') AS t;"
        done=$(( done + k ))
        c=$(( c + 1 ))
      done
    done
    echo "PRAGMA wal_checkpoint(TRUNCATE);"
  } | sqlite3 "$db" >/dev/null
  # Written back now, so the kernel's writeback of the fill does not compete with the fsyncs
  # being measured.
  sync
  local total=0 t
  for t in $(sqlite3 "$db" "SELECT name FROM sqlite_master WHERE type = 'table' AND name LIKE 'idempotency_window_%'"); do
    total=$(( total + $(sqlite3 "$db" "SELECT count(*) FROM $t") ))
  done
  [ "$total" -gt "$n" ] || { echo "fill of $db failed ($total records)" >&2; exit 1; }
}

# pg_url SCHEMA: the PostgreSQL URL whose search_path is SCHEMA.
pg_url() { echo "$pg?options=-c%20search_path%3D$1"; }

# fill_pg SCHEMA N [EXPIRES] [OFFSETS]: as fill_sqlite, over the windows OFFSETS (default
# 0..23: the 24 windows of the template's TTL class, its own and the 23 before it, each a
# partition of idempotency_record); each window before the template's is filled, then given the
# key, index and constraints the store gives a window, then attached, as the store's own DDL
# would. EXPIRES: unix ms, or `keep` (default) for the template's expiry.
fill_pg() {
  local url tmpl class index n=$2 expires=${3:-keep} offsets=${4:-$(seq 0 23)} count first
  [ "$expires" = keep ] && expires=t.expires_at
  count=$(wc -w <<<"$offsets")
  first=${offsets%%[[:space:]]*}
  url=$(pg_url "$1")
  tmpl=$(psql -Atq -v ON_ERROR_STOP=1 "$url" -c "SELECT tableoid::regclass::text FROM idempotency_record WHERE key = 'template'")
  case $tmpl in idempotency_window_*_*) ;; *) echo "fill of $1: template in '$tmpl'" >&2; exit 1 ;; esac
  class=${tmpl#idempotency_window_}
  index=${tmpl##*_}
  class=${class%_*}
  {
    echo "SET maintenance_work_mem = '1GB';"
    for off in $offsets; do
      local w=$(( index - off )) per name
      name=idempotency_window_${class}_$w
      # The first window takes the remainder, so the windows hold N in all.
      [ "$off" = "$first" ] && per=$(( n - n / count * (count - 1) )) || per=$(( n / count ))
      [ "$off" = 0 ] || echo "CREATE TABLE $name (LIKE idempotency_record INCLUDING DEFAULTS);"
      echo "INSERT INTO $name
          SELECT t.scope, substr(md5(random()::text), 1, 16) || '-fill-$w-' || g,
            md5(random()::text) || md5(random()::text), t.status, t.lease_until, t.http_status,
            t.response_body, t.response_headers, t.created_at, $expires, t.phase,
            t.phase_data, $class, $w
          FROM generate_series(1, $per) AS g, (SELECT * FROM $tmpl WHERE key = 'template') AS t;"
      [ "$off" = 0 ] || echo "ALTER TABLE $name ADD PRIMARY KEY (scope, key),
          ADD CONSTRAINT ${name}_status CHECK (status IN ('running', 'succeeded', 'failed')),
          ADD CONSTRAINT ${name}_bound CHECK (class_ms = $class AND win = $w);
        CREATE INDEX ${name}_expires ON $name (expires_at);
        ALTER TABLE idempotency_record ATTACH PARTITION $name
          FOR VALUES FROM ($class, $w) TO ($class, $(( w + 1 )));"
    done
    echo "VACUUM ANALYZE; CHECKPOINT;"
  } | psql -q -v ON_ERROR_STOP=1 "$url" >/dev/null
  sync
  local total
  total=$(psql -Atq "$url" -c "SELECT count(*) FROM idempotency_record")
  [ "$total" -gt "$n" ] || { echo "fill of $1 failed ($total records)" >&2; exit 1; }
}

# keyed_run MODE DB ROUND: wrk against the bench server; sets $r and $p.
keyed_run() {
  start_keyed "$1" "$2"
  local o
  o=$(wrk -t2 -c64 -d"${secs}s" --latency -s bench/payments.lua "http://$addr" -- "g$3$$" random)
  stop
  wrk_check "$1 on $2" "$o"
  r=$(wrk_rps "$o")
  p=$(wrk_p99_ms "$o")
}

part_records() {
  local kinds="" m
  for m in $sqlite_modes; do kinds="$kinds $m:empty $m:full"; done
  echo "== records: $records live records against an empty table" >&2
  local t=$(( $(now_ms) ))
  if [ -n "$sqlite_modes" ]; then
    start_keyed keyed "$work/full.db"
    template
    stop
    fill_sqlite "$work/full.db" "$records" keep "$(seq 0 23)"
    echo "  SQLite filled in $(( ($(now_ms) - t) / 1000 )) s, $(du -m "$work/full.db" | cut -f1) MB" >&2
  fi
  if [ "$pg" != none ]; then
    kinds="$kinds keyed_postgres:empty keyed_postgres:full"
    for s in full empty; do
      psql -q -v ON_ERROR_STOP=1 "$pg" -c "DROP SCHEMA IF EXISTS bench_growth_$s CASCADE" \
        -c "CREATE SCHEMA bench_growth_$s" >/dev/null 2>&1
      start_keyed keyed_postgres "$(pg_url "bench_growth_$s")"
      [ "$s" = full ] && template
      stop
    done
    t=$(now_ms)
    fill_pg bench_growth_full "$records"
    echo "  PostgreSQL filled in $(( ($(now_ms) - t) / 1000 )) s" >&2
  fi
  declare -A rps p99
  local kind mode table
  for round in $(seq "$rounds"); do
    for kind in $kinds; do
      mode=${kind%:*}
      table=${kind#*:}
      if [ "$mode" = keyed_postgres ]; then
        [ "$table" = empty ] &&
          psql -q "$pg" -c "TRUNCATE bench_growth_empty.idempotency_record" >/dev/null
        keyed_run "$mode" "$(pg_url "bench_growth_$table")" "$round"
      elif [ "$table" = empty ]; then
        keyed_run "$mode" "$work/empty-$mode-$round.db" "$round"
      else
        keyed_run "$mode" "$work/full.db" "$round"
      fi
      echo "  round $round $kind: req/s=$r p99_ms=$p" >&2
      rps[$kind]+="$r "
      p99[$kind]+="$p "
    done
  done
  # Names: records_sqlite_* for `keyed`, records_pg_* for PostgreSQL, records_MODE_* else.
  local name
  for kind in $kinds; do
    mode=${kind%:*}
    table=${kind#*:}
    case $mode in
      keyed) name=sqlite ;;
      keyed_postgres) name=pg ;;
      *) name=$mode ;;
    esac
    result "records_${name}_${table}_rps" "$(median <<<"${rps[$kind]}")"
    result "records_${name}_${table}_p99_ms" "$(median <<<"${p99[$kind]}")"
  done
  result records_count "$records"
  rm -f "$work"/*.db*
  if [ "$pg" != none ]; then
    psql -q "$pg" -c "DROP SCHEMA bench_growth_full CASCADE" -c "DROP SCHEMA bench_growth_empty CASCADE" >/dev/null 2>&1
  fi
}

# load_p99 DURATION RATE [WARMUP]: `backstop load` against $addr; prints "p99_ms ok skipped".
load_p99() {
  "$dir/backstop" load --target "http://$addr" --rate "$2" --duration "${1}s" --policy naive \
    --timeout 5s --warmup "${3:-0s}" --json 2>/dev/null | python3 -c '
import json, sys
s = json.load(sys.stdin)
first = [l for l in s["latency_ms"] if l["attempt"] == "1"][0]
print(first["p99_ms"], s["outcomes"].get("ok", 0), s["skipped"])'
}

# paced SECONDS PAUSE_MS RUN: wrk with 64 connections, each pausing PAUSE_MS before a request.
paced() {
  wrk -t2 -c64 -d"${1}s" --latency -s bench/payments_paced.lua "http://$addr" -- "$3" - "$2"
}

# sweep_store KIND ROUND: sets serve_store for the sweep part (SWEEP_STORE=postgres: a fresh
# schema of $pg; SQLite otherwise, serve's default file).
sweep_store() {
  serve_store=backstop.db
  if [ "${SWEEP_STORE:-sqlite}" = postgres ]; then
    psql -q -v ON_ERROR_STOP=1 "$pg" -c "DROP SCHEMA IF EXISTS bench_sweep_$1 CASCADE" \
      -c "CREATE SCHEMA bench_sweep_$1" >/dev/null 2>&1
    serve_store=$(pg_url "bench_sweep_$1")
  fi
}

# fill_sweep DIR KIND N EXPIRES: the sweep part's records, in the three windows before the
# template's, in the store sweep_store chose.
fill_sweep() {
  if [ "${SWEEP_STORE:-sqlite}" = postgres ]; then
    fill_pg "bench_sweep_$2" "$3" "$4" "1 2 3"
  else
    fill_sqlite "$1/backstop.db" "$3" "$4" "1 2 3"
  fi
}

part_sweep() {
  local store=${SWEEP_STORE:-sqlite} pre=sweep
  [ "$store" = postgres ] && pre=sweep_pg
  echo "== sweep ($store): $expired expired records swept while serving at half capacity" >&2
  sweep_store capacity
  start_serve "$work/capacity"
  local o
  o=$(wrk -t2 -c64 -d"${secs}s" --latency -s bench/payments.lua "http://$addr" -- "cap$$")
  stop
  wrk_check "serve" "$o"
  local capacity rate pause
  capacity=$(wrk_rps "$o")
  rate=$(echo "$capacity / 2" | bc)
  # 64 connections, each waiting `pause` ms before its next request (plus ~2 ms of latency).
  pause=$(( 64000 / rate - 2 ))
  result "${pre}_capacity_rps" "$capacity"
  result "${pre}_rate" "$rate"
  declare -A p99 served
  for round in $(seq "$rounds"); do
    for kind in unexpired sweeping; do
      local d=$work/sweep-$kind-$round lead=8000 fill_start expires
      sweep_store "$kind$round"
      start_serve "$d" --sweep-every 1s
      template
      stop
      fill_start=$(now_ms)
      # The records expire `lead` ms after the load starts (3 s of warm-up, then 5 s into the
      # measured run): the fill's own duration (timed on the first fill) is waited out first.
      if [ "$kind" = sweeping ]; then
        expires=$(( fill_start + ${fill_ms:-20000} * 3 / 2 + 2000 + lead ))
      else
        expires=keep
      fi
      fill_sweep "$d" "$kind$round" "$expired" "$expires"
      [ "$kind" = unexpired ] && fill_ms=$(( $(now_ms) - fill_start ))
      if [ "$kind" = sweeping ]; then
        local wait_ms=$(( expires - lead - $(now_ms) ))
        [ "$wait_ms" -gt 0 ] && sleep "$(echo "$wait_ms / 1000" | bc -l)"
      fi
      start_serve "$d" --sweep-every 1s
      local load_start load_end
      load_start=$(now_ms)
      # Warm-up: connections opened and serve's slow start passed before anything counts. The
      # first one also calibrates the pause: a request's cycle is pause + latency.
      o=$(paced 3 "$pause" "w$kind$round$$")
      wrk_check "serve" "$o"
      if [ -z "${calibrated:-}" ]; then
        local latency_ms
        latency_ms=$(echo "64000 / $(wrk_rps "$o") - $pause" | bc)
        pause=$(( 64000 / rate - latency_ms ))
        [ "$pause" -ge 1 ] || pause=1
        calibrated=1
        result "${pre}_pause_ms" "$pause"
      fi
      o=$(paced "$sweep_secs" "$pause" "$kind$round$$")
      load_end=$(now_ms)
      stop
      wrk_check "serve" "$o"
      local lp r swept
      lp=$(wrk_p99_ms "$o")
      r=$(wrk_rps "$o")
      swept=$(sed -n '/"message":"idempotency sweep"/s/.*"deleted":\([0-9]*\).*"elapsed_ms":\([0-9]*\).*/\1 \2/p' \
        "$d/serve.log" | tail -n1)
      echo "  round $round $kind: req/s=$r p99_ms=$lp swept(deleted ms)=${swept:-none}" >&2
      if [ "$kind" = sweeping ]; then
        local deleted sweep_ms
        read -r deleted sweep_ms <<<"${swept:-0 0}"
        if [ "$deleted" -lt "$expired" ]; then
          echo "the sweep deleted ${deleted} of $expired records during the load" >&2
          exit 1
        fi
        # The sweep starts at the first tick (1 s) after the records expire.
        local began=$(( expires - load_start - 3000 ))
        if [ "$began" -lt 0 ] || [ $(( began + sweep_ms )) -gt $(( load_end - load_start - 3000 )) ]; then
          echo "the sweep ($began ms + $sweep_ms ms) was not inside the measured run" >&2
          exit 1
        fi
        result "${pre}_round${round}_ms" "$sweep_ms"
      fi
      p99[$kind]+="$lp "
      served[$kind]+="$r "
      rm -rf "$d"
    done
  done
  for kind in unexpired sweeping; do
    result "${pre}_p99_${kind}_ms" "$(median <<<"${p99[$kind]}")"
    result "${pre}_${kind}_rps" "$(median <<<"${served[$kind]}")"
  done
  result "${pre}_records" "$expired"
  if [ "$store" = postgres ]; then
    local k r
    for k in capacity unexpired sweeping; do
      for r in "" $(seq "$rounds"); do
        psql -q "$pg" -c "DROP SCHEMA IF EXISTS bench_sweep_$k$r CASCADE" >/dev/null 2>&1
      done
    done
  fi
}

part_rss() {
  echo "== rss: serve after 10 thousand and after $payments payments" >&2
  start_serve "$work/rss"
  local first total=0 o
  result rss_start_kib "$(rss_kib "$pid" VmRSS)"
  read -r _ first _ <<<"$(load_p99 5 2000)"
  result rss_after_10k_kib "$(rss_kib "$pid" VmRSS)"
  total=$first
  while [ "$total" -lt "$payments" ]; do
    o=$(wrk -t2 -c64 -d30s -s bench/payments.lua "http://$addr" -- "rss$total$$")
    wrk_check serve "$o"
    total=$(( total + $(wrk_requests "$o") ))
    echo "  $total payments" >&2
  done
  result rss_payments "$total"
  result rss_after_payments_kib "$(rss_kib "$pid" VmRSS)"
  result rss_peak_kib "$(rss_kib "$pid" VmHWM)"
  result rss_threads "$(ls "/proc/$pid/task" | wc -l)"
  stop
  rm -rf "$work/rss"
}

for part in $parts; do "part_$part"; done

v() { awk -v k="$1" '$1==k {print $2}' "$out"; }
echo
echo "| measure | figures | ratio |"
echo "|---|---|---:|"
if [[ $parts == *records* ]]; then
  for s in sqlite pg $(tr ' ' '\n' <<<"$sqlite_modes" | grep -vx keyed); do
    [ -n "$(v "records_${s}_full_rps")" ] || continue
    printf '| keyed, %s live records vs empty, %s | %.0f vs %.0f req/s | %sx |\n' "$records" \
      "$s" "$(v "records_${s}_full_rps")" "$(v "records_${s}_empty_rps")" \
      "$(ratio "$(v "records_${s}_full_rps")" "$(v "records_${s}_empty_rps")")"
  done
fi
if [[ $parts == *sweep* ]]; then
  printf '| serve p99 at %s/s (half of %.0f), sweeping %s vs not | %s vs %s ms | %sx |\n' \
    "$(v sweep_rate)" "$(v sweep_capacity_rps)" "$expired" "$(v sweep_p99_sweeping_ms)" \
    "$(v sweep_p99_unexpired_ms)" "$(ratio "$(v sweep_p99_sweeping_ms)" "$(v sweep_p99_unexpired_ms)")"
fi
if [[ $parts == *rss* ]]; then
  printf '| serve RSS after %s payments vs 10k | %s vs %s KiB | %sx |\n' "$(v rss_payments)" \
    "$(v rss_after_payments_kib)" "$(v rss_after_10k_kib)" \
    "$(ratio "$(v rss_after_payments_kib)" "$(v rss_after_10k_kib)")"
fi
echo "(at $(git rev-parse --short HEAD): bench/growth.sh $secs $rounds; figures in $out)"
