# Helpers shared by the bench scripts (sourced, not run).

# wait_addr FILE SED: the first address FILE shows, by the sed expression (10 s at most).
wait_addr() {
  local a
  for _ in $(seq 200); do
    a=$(sed -n "$2" "$1" 2>/dev/null | head -n1)
    [ -n "$a" ] && { echo "$a"; return; }
    sleep 0.05
  done
  echo "server did not start:" >&2
  cat "$1" >&2
  exit 1
}

# stop_pid PID: SIGTERM, then wait (at most 20 s) until the process has gone.
stop_pid() {
  kill "$1" 2>/dev/null || true
  for _ in $(seq 400); do
    local state
    state=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null || true)
    { [ -z "$state" ] || [ "$state" = Z ]; } && return
    sleep 0.05
  done
  kill -9 "$1" 2>/dev/null || true
}

# wrk_rps OUT / wrk_p99_ms OUT / wrk_requests OUT: figures from wrk's --latency output.
wrk_rps() { awk '/^Requests\/sec/ {print $2}' <<<"$1"; }
wrk_requests() { awk '/requests in/ {print $1}' <<<"$1"; }
wrk_p99_ms() {
  awk '$1=="99%" {v=$2; if (v ~ /us$/) {sub(/us/,"",v); v=v/1000} else if (v ~ /ms$/) {sub(/ms/,"",v)} else if (v ~ /s$/) {sub(/s/,"",v); v=v*1000}; print v}' <<<"$1"
}
# wrk_check MODE OUT: fails the run when wrk saw an answer other than 2xx or a socket error.
wrk_check() {
  if grep -q "Non-2xx\|Socket errors" <<<"$2"; then
    echo "$1: non-2xx answers or socket errors" >&2
    echo "$2" >&2
    exit 1
  fi
}

median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
ratio() { echo "scale=2; $1 / $2" | bc -l | sed "s/^\./0./"; }
# rss_kib PID FIELD: VmRSS or VmHWM of PID in KiB.
rss_kib() { awk -v f="$2:" '$1==f {print $2}' "/proc/$1/status"; }
