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

# A free TCP port on 127.0.0.1 (for a server that cannot be told to pick its own).
free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# wait_port PORT: until something listens on 127.0.0.1:PORT (a minute at most).
wait_port() {
  for _ in $(seq 1200); do
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return
    sleep 0.05
  done
  echo "nothing listens on port $1" >&2
  exit 1
}

# nginx_conf DIR PORT UPSTREAM [DIRECTIVE...]: writes DIR/nginx.conf for the proxy benchmarks:
# nginx (one worker, no access log) on 127.0.0.1:PORT as the reverse proxy of UPSTREAM
# (host:port), keep-alive to it; each extra argument is a main-context directive
# ("master_process off;").
nginx_conf() {
  local dir=$1 port=$2 upstream=$3
  shift 3
  mkdir -p "$dir"
  {
    printf '%s\n' "$@"
    cat <<CONF
worker_processes 1;
daemon off;
pid $dir/nginx.pid;
error_log $dir/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $dir/body;
  proxy_temp_path $dir/proxy;
  fastcgi_temp_path $dir/fastcgi;
  uwsgi_temp_path $dir/uwsgi;
  scgi_temp_path $dir/scgi;
  upstream bench { server $upstream; keepalive 128; }
  server {
    listen 127.0.0.1:$port;
    location / {
      proxy_pass http://bench;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
    }
  }
}
CONF
  } >"$dir/nginx.conf"
}

# previous_build COMMIT ARTIFACT CARGO_ARGS...: COMMIT's build of ARTIFACT (a path under the
# profile's directory, e.g. examples/http_bench_server or backstop), made once in a temporary
# `git worktree` with its own target directory (profile `profiling`, or `release` at commits
# before it existed, whose release kept line tables) and cached as
# $CARGO_TARGET_DIR/previous/COMMIT/NAME; prints that path.
previous_build() {
  local commit=$1 artifact=$2
  shift 2
  local cache profile
  cache=$(realpath -m "${CARGO_TARGET_DIR:-target}")/previous/$commit
  local built=$cache/$(basename "$artifact")
  if [ ! -x "$built" ]; then
    echo "== building $artifact of $commit in $cache" >&2
    mkdir -p "$cache"
    [ -d "$cache/src" ] || git worktree add --detach "$cache/src" "$commit" >&2
    if git show "$commit:Cargo.toml" | grep -q '^\[profile\.profiling\]'; then
      profile=profiling
    else
      profile=release
    fi
    (cd "$cache/src" && CARGO_TARGET_DIR="$cache/target" cargo build --profile "$profile" -q "$@")
    cp "$cache/target/$profile/$artifact" "$built"
    git worktree remove --force "$cache/src"
  fi
  echo "$built"
}

# start_bare_upstream TARGET WORK [PREFIX...]: the proxy benchmarks' upstream, TARGET's
# http_bench_server `bare` (POST /v1/payments echoes its JSON) with one tokio worker, run under
# PREFIX (e.g. `taskset -c 1`); its pid is added to the caller's `pids`, its address put in
# `upstream`.
start_bare_upstream() {
  local target=$1 work=$2
  shift 2
  (TOKIO_WORKER_THREADS=1 "$@" "$target/examples/http_bench_server" bare "$work/unused.db" \
    >"$work/upstream.out" 2>&1 & echo $! >"$work/upstream.pid")
  pids+=("$(cat "$work/upstream.pid")")
  upstream=$(wait_addr "$work/upstream.out" 's/^listening on //p')
}
