# Shared by the command-line test scripts (sourced): a scratch folder, failure counting, and
# expect STATUS PATTERN CMD... (runs CMD, checks its exit status and that stderr matches PATTERN;
# stdout and stderr stay in $tmp/out and $tmp/err for further checks).
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
