#!/usr/bin/env bash
# The keyed route (http_bench_server keyed: full server stack, SQLite FULL with group commit, a
# trivial handler) of a previous commit against this tree's, side by side in one run, so that a
# regression of the library's cost per request shows up:
#   - COMMIT's http_bench_server is built once in a temporary `git worktree` with its own target
#     directory and cached as $CARGO_TARGET_DIR/previous/COMMIT/http_bench_server (profile
#     `profiling`, or `release` at commits before it existed, whose release kept line tables);
#   - both binaries then run interleaved over ROUNDS rounds (old first in odd rounds, new first
#     in even ones), in two placements: pinned (server on core 0 with one tokio worker, wrk -t1
#     -c64 on core 1) and unpinned (both on both cores, default workers, wrk -t2 -c256);
#   - per run, the server's CPU time (utime + stime of the whole process, exited threads
#     included) divided by the requests wrk completed, and req/s.
# Prints medians and new / old ratios; `name value` lines go to OUT (default
# target/bench-previous.txt) for bench/targets.sh. Needs wrk and bc.
# Usage: bench/previous.sh [COMMIT] [SECONDS] [ROUNDS] [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
commit=$(git rev-parse --short=7 "${1:-7481e65}^{commit}")
secs=${2:-5}
rounds=${3:-3}
results=${4:-target/bench-previous.txt}
mkdir -p "$(dirname "$results")"
: >"$results"
target=$(realpath -m "${CARGO_TARGET_DIR:-target}")
old=$(previous_build "$commit" examples/http_bench_server -p backstop --example http_bench_server)
cargo build --profile profiling -q -p backstop --features postgres --example http_bench_server
new=$target/profiling/examples/http_bench_server
work=$(mktemp -d)
pid=""
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -rf "$work"' EXIT
ticks=$(getconf CLK_TCK)

# cpu_ticks: utime + stime of the server process so far (all its threads, exited ones too).
cpu_ticks() { awk '{print $14 + $15}' "/proc/$pid/stat"; }

# run BIN PLACEMENT TAG: sets $us (server CPU us per request) and $r (req/s).
run() {
  local bin=$1 placement=$2 tag=$3 log=$work/server.log server=() client=() before after out n
  case $placement in
    pinned) server=(env TOKIO_WORKER_THREADS=1 taskset -c 0); client=(taskset -c 1 wrk -t1 -c64) ;;
    unpinned) server=(env); client=(wrk -t2 -c256) ;;
  esac
  rm -f "$log" "$work/db"*
  "${server[@]}" "$bin" keyed "$work/db" >"$log" 2>&1 &
  pid=$!
  addr=$(wait_addr "$log" 's/^listening on //p')
  before=$(cpu_ticks)
  out=$("${client[@]}" -d"${secs}s" -s bench/payments.lua "http://$addr" -- "$tag$$")
  after=$(cpu_ticks)
  stop_pid "$pid"
  pid=""
  wrk_check "$tag" "$out"
  n=$(wrk_requests "$out")
  r=$(wrk_rps "$out")
  us=$(echo "scale=1; ($after - $before) * 1000000 / $ticks / $n" | bc -l)
}

declare -A cpu rps
for round in $(seq "$rounds"); do
  order="old new"
  [ $((round % 2)) = 0 ] && order="new old"
  for placement in pinned unpinned; do
    for which in $order; do
      bin=$old
      [ "$which" = new ] && bin=$new
      run "$bin" "$placement" "prev$which$placement$round"
      echo "round $round $placement $which: cpu_us=$us req/s=$r" >&2
      cpu[$placement-$which]+="$us "
      rps[$placement-$which]+="$r "
    done
  done
done

printf '%-9s %-10s %12s %10s\n' placement binary "CPU us/req" "req/s"
for placement in pinned unpinned; do
  for which in old new; do
    c=$(median <<<"${cpu[$placement-$which]}")
    r=$(median <<<"${rps[$placement-$which]}")
    label=$commit
    [ "$which" = new ] && label=$(git rev-parse --short=7 HEAD)
    printf '%-9s %-10s %12.1f %10.0f\n' "$placement" "$label" "$c" "$r"
    echo "${placement}_${which}_cpu_us $c" >>"$results"
    echo "${placement}_${which}_rps $r" >>"$results"
  done
  c_old=$(median <<<"${cpu[$placement-old]}") c_new=$(median <<<"${cpu[$placement-new]}")
  r_old=$(median <<<"${rps[$placement-old]}") r_new=$(median <<<"${rps[$placement-new]}")
  printf '%-9s new/old: CPU per request %sx, req/s %sx\n' "$placement" \
    "$(ratio "$c_new" "$c_old")" "$(ratio "$r_new" "$r_old")"
done
echo "previous_commit $commit" >>"$results"
echo "(keyed mode; pinned: server on core 0, one worker, wrk -t1 -c64 on core 1; unpinned: wrk -t2 -c256, both on both cores; ${secs} s x $rounds interleaved rounds, medians)"
