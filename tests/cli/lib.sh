# Shared by the command-line test scripts (sourced): a scratch folder, failure counting,
# expect STATUS PATTERN CMD... (runs CMD, checks its exit status and that stderr matches PATTERN;
# stdout and stderr stay in $tmp/out and $tmp/err for further checks), and serve_port.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }

expect() {
  local status=$1 pattern=$2
  shift 2
  "$@" >"$tmp/out" 2>"$tmp/err"
  local got=$?
  [ "$got" -eq "$status" ] || fail "$* exited $got, expected $status: $(tail -2 "$tmp/err")"
  grep -q -- "$pattern" "$tmp/err" || fail "$*: stderr lacks '$pattern': $(tail -2 "$tmp/err")"
}

# serve_port LOG PID: waits (up to 240 s: under the sanitizers beside other tests the start is
# slow) until the strata serve whose stderr is LOG says it is ready, and prints its API port;
# prints nothing when PID exits first or the time runs out.
serve_port() {
  local port=
  for _ in $(seq 1 1200); do
    # LOG may not exist yet: the server's shell opens it after the caller moves on.
    port=$(sed -n 's/.*ready: serving .* on port \([0-9]*\).*/\1/p' "$1" 2>/dev/null || true)
    [ -n "$port" ] && break
    kill -0 "$2" 2>/dev/null || break
    sleep 0.2
  done
  echo "$port"
}
