# Sourced by bench/instructions.sh and bench/layers.sh: builds the stack_calls example and
# defines `per_call MODE [ARGS...]`, its instructions per call counted by valgrind's callgrind
# as the difference of a $small and a $large run (which removes start-up and warm-up costs).
# Expects `small` and `large` to be set. Needs valgrind (apt-get install valgrind).
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# The profiling profile: release code with line tables, for perf or callgrind on this binary.
cargo build --profile profiling -q -p backstop --example stack_calls
bin=${CARGO_TARGET_DIR:-target}/profiling/examples/stack_calls
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# per_call MODE [ARGS...]: instructions per call of `stack_calls MODE CALLS [ARGS...]`.
per_call() {
  local mode=$1 totals=() calls
  shift
  for calls in "$small" "$large"; do
    valgrind --tool=callgrind --callgrind-out-file="$work/out" "$bin" "$mode" "$calls" "$@" \
      >/dev/null 2>"$work/log"
    totals+=("$(sed -n 's/^summary: //p' "$work/out")")
  done
  echo $(( (totals[1] - totals[0]) / (large - small) ))
}
