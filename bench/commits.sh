#!/usr/bin/env bash
# Durable commits per payment of `backstop serve`, counted from outside the process, on both
# stores (release build, an external `backstop psp` so the PSP's own syncs are not counted):
#   SQLite     - `strace -f -y -e trace=fsync,fdatasync,pwrite64` on serve; the syncs issued
#                while PAYMENTS sequential payments run (after one warm-up payment), per
#                payment, split by thread: the store's background checkpointer (the thread
#                that syncs the database file: it syncs the WAL, copies, syncs the database)
#                and the writer (everything else). Of the writer's WAL syncs, a WAL restart
#                (the first frame after a checkpoint copied the whole WAL; SQLite writes and
#                syncs a new 32-byte WAL header, even for a commit that asks for no sync) is
#                counted apart: the writer's syncs less the restarts are its commit syncs;
#   PostgreSQL - the delta of `pg_stat_wal.wal_sync` (the whole cluster) over a serve process
#                that makes PAYMENTS sequential payments, read once its backends have exited
#                (a backend reports its WAL statistics at the latest when it exits); the same
#                delta over a serve process that makes none (start, migrations check, stop) is
#                printed too. Nothing else may use the cluster meanwhile: the script refuses to
#                start when another client is connected.
# Each payment is one curl (a new connection) with a new order and Idempotency-Key and a
# merchant's bearer key; every answer must be 201.
# `name value` lines go to OUT (default target/bench-commits.txt) for bench/targets.sh.
# Needs strace, curl and psql (apt-get install strace curl postgresql-client) and PostgreSQL
# on 127.0.0.1:5432 (PG=URL for another, PG=none skips it).
# KEEP=FILE keeps the strace log. Usage: bench/commits.sh [PAYMENTS] [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
n=${1:-200}
results=${2:-target/bench-commits.txt}
pg=${PG:-postgres://postgres@127.0.0.1:5432/test}
mkdir -p "$(dirname "$results")"
: >"$results"
cargo build --release -q -p backstop-cli
bin=$(realpath "${CARGO_TARGET_DIR:-target}/release/backstop")
work=$(mktemp -d)
pids=()
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$work"' EXIT
export BACKSTOP_API_KEYS="bench=commits-bench-key"

"$bin" --log-format json psp --listen 127.0.0.1:0 --db "$work/psp.db" >"$work/psp.log" 2>&1 &
pids+=($!)
psp=$(wait_addr "$work/psp.log" 's/.*"message":"psp listening".*"addr":"\([^"]*\)".*/\1/p')

# start_serve STORE LOG [PREFIX...]: starts serve (under PREFIX, e.g. strace) and sets $pid
# (serve's, not the prefix's: SIGTERM must reach serve), $runner (the process started) and
# $base.
start_serve() {
  local store=$1 log=$2
  shift 2
  "$@" "$bin" --log-format json serve --http 127.0.0.1:0 --grpc 127.0.0.1:0 --store "$store" \
    --psp "http://$psp" >"$log" 2>&1 &
  runner=$!
  pid=$runner
  pids+=("$pid")
  if [ $# -gt 0 ]; then
    for _ in $(seq 200); do
      pid=$(pgrep -P "$runner" || true)
      [ -n "$pid" ] && break
      sleep 0.05
    done
    pids+=("$pid")
  fi
  base=$(wait_addr "$log" 's/.*"message":"payment service listening".*"http":"\([^"]*\)".*/\1/p')
  base=http://${base#http://}
}

# pay RUN FROM TO: sequential payments FROM..TO, each must be answered 201.
pay() {
  local code
  for i in $(seq "$2" "$3"); do
    code=$(curl -sS -o /dev/null -w '%{http_code}' -X POST "$base/v1/payments" \
      -H "Authorization: Bearer commits-bench-key" -H "Idempotency-Key: commits-$1-$i" \
      -H 'Content-Type: application/json' \
      -d "{\"order_id\":\"commits-$1-$i\",\"amount_cents\":1999,\"currency\":\"USD\"}")
    [ "$code" = 201 ] || { echo "payment $1-$i answered $code" >&2; exit 1; }
  done
}

# syncs FILTER: the sync calls strace logged so far whose file matches FILTER (a call cut by
# another thread's line shows as `fsync(... <unfinished ...>` and counts once).
syncs() { grep -cE "^[0-9]+ +f(data)?sync\([0-9]+<[^>]*$1>" "$work/strace.log" || true; }

echo "== SQLite: strace on serve, $n sequential payments" >&2
run=sqlite$$
start_serve "$work/backstop.db" "$work/serve-sqlite.log" \
  strace -f -y -qq -e trace=fsync,fdatasync,pwrite64 -o "$work/strace.log"
pay "$run" 0 0
sleep 1
before_all=$(syncs "") before_wal=$(syncs "-wal") before_line=$(wc -l <"$work/strace.log")
t0=$(date +%s.%N)
pay "$run" 1 "$n"
t1=$(date +%s.%N)
sleep 1
after_all=$(syncs "") after_wal=$(syncs "-wal") after_line=$(wc -l <"$work/strace.log")
stop_pid "$pid"
# strace exits once serve has; should serve have outlived its SIGTERM (once seen: the script
# waited here for good), stop_pid ended it with SIGKILL, and strace goes too.
stop_pid "$runner"
wait "$runner" || true
[ -z "${KEEP:-}" ] || cp "$work/strace.log" "$KEEP"
all=$((after_all - before_all))
wal=$((after_wal - before_wal))
# Per thread, the syncs of the window; a thread that synced the database file is the
# checkpointer. WAL restarts: 32-byte writes at offset 0 of the WAL.
split=$(awk -v b="$before_line" -v e="$after_line" 'NR > b && NR <= e' "$work/strace.log" | awk '
  /^[0-9]+ +f(data)?sync\(/ { s[$1]++; if ($0 !~ /-wal>/) ckpt[$1] = 1 }
  /^[0-9]+ +pwrite64\([0-9]+<[^>]*-wal>, .*, 32, 0\)/ { restarts++ }
  END { for (t in s) if (t in ckpt) c += s[t]; else w += s[t]
        printf "%d %d %d\n", w, c, restarts }')
read -r writer checkpointer restarts <<<"$split"
{
  echo "sqlite_payments $n"
  echo "sqlite_syncs $all"
  echo "sqlite_syncs_per_payment $(echo "scale=3; $all / $n" | bc -l | sed 's/^\./0./')"
  echo "sqlite_wal_syncs $wal"
  echo "sqlite_other_syncs $((all - wal))"
  echo "sqlite_writer_syncs $writer"
  echo "sqlite_wal_restarts $restarts"
  echo "sqlite_writer_commit_syncs $((writer - restarts))"
  echo "sqlite_writer_commit_syncs_per_payment $(echo "scale=3; ($writer - $restarts) / $n" | bc -l | sed 's/^\./0./')"
  echo "sqlite_checkpointer_syncs $checkpointer"
  echo "sqlite_payments_per_s $(echo "scale=1; $n / ($t1 - $t0)" | bc -l)"
  echo "sqlite_syncs_whole_process $(syncs "")"
} | tee -a "$results"
echo "(files synced during the measured payments:)" >&2
awk -v b="$before_all" '/^[0-9]+ +f(data)?sync\(/ && ++k > b' "$work/strace.log" |
  sed -n 's/.*f\(data\)\{0,1\}sync([0-9]*<\([^>]*\)>.*/\2/p' | sed "s|$work/||" | sort | uniq -c >&2

if [ "$pg" != none ]; then
  others="SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()"
  busy=$(psql -Atq "$pg" -c "$others")
  if [ "$busy" != 0 ]; then
    echo "PostgreSQL: $busy other clients connected; the WAL flush count would include theirs" >&2
    psql -q "$pg" -c "SELECT pid, datname, application_name, state, query FROM pg_stat_activity WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()" >&2
    exit 1
  fi
  schema=bench_commits
  psql -q -v ON_ERROR_STOP=1 "$pg" -c "DROP SCHEMA IF EXISTS $schema CASCADE" \
    -c "CREATE SCHEMA $schema" >/dev/null 2>&1
  store="$pg?options=-c%20search_path%3D$schema"
  # wal_sync: the cluster's count once every other client backend has gone (10 s at most).
  wal_sync() {
    for _ in $(seq 200); do
      [ "$(psql -Atq "$pg" -c "$others")" = 0 ] && break
      sleep 0.05
    done
    psql -Atq "$pg" -c "SELECT wal_sync FROM pg_stat_wal"
  }
  echo "== PostgreSQL: pg_stat_wal.wal_sync over a serve process, $n sequential payments" >&2
  run=pg$$
  # A first process migrates the schema and makes one payment.
  start_serve "$store" "$work/serve-pg-warm.log"
  pay "$run" 0 0
  stop_pid "$pid"
  # A process that makes no payment: what a start and a stop cost.
  w0=$(wal_sync)
  start_serve "$store" "$work/serve-pg-idle.log"
  stop_pid "$pid"
  w1=$(wal_sync)
  start_serve "$store" "$work/serve-pg.log"
  t0=$(date +%s.%N)
  pay "$run" 1 "$n"
  t1=$(date +%s.%N)
  stop_pid "$pid"
  w2=$(wal_sync)
  psql -q "$pg" -c "DROP SCHEMA $schema CASCADE" >/dev/null 2>&1
  {
    echo "pg_payments $n"
    echo "pg_wal_syncs $((w2 - w1))"
    echo "pg_wal_syncs_per_payment $(echo "scale=3; ($w2 - $w1) / $n" | bc -l | sed 's/^\./0./')"
    echo "pg_wal_syncs_start_stop $((w1 - w0))"
    echo "pg_payments_per_s $(echo "scale=1; $n / ($t1 - $t0)" | bc -l)"
  } | tee -a "$results"
fi
