#!/usr/bin/env bash
# The CPU benchmark programs still run and print what docs/benchmarks.md reads from them, at tiny
# sizes (the numbers are not checked here: benchmarks are for a quiet machine): the NVMe tier's
# io_uring spill/restore on a real file, the pool benches, prefill on the default model and the
# TCP data plane over loopback. Also
# their usage errors (status 2) and --help (status 0).
# usage: tests/bench/test_bench_smoke.sh BENCH_DIR
set -uo pipefail
bin=${1:?usage: test_bench_smoke.sh BENCH_DIR}
# shellcheck source=tests/cli/lib.sh
source "$(dirname "$0")/../cli/lib.sh"

field() { grep -oE "(^| )$1=[^ ]+" "$tmp/out" | head -1 | cut -d= -f2; }

"$bin/strata-offload-bench" --dir "$tmp/spill" --total-mib 4 --block-bytes 16384 --qd 4 >"$tmp/out" 2>"$tmp/err" ||
  fail "offload bench: $(cat "$tmp/err")"
[ "$(field blocks)" = 256 ] && [ "$(field failed)" = 0 ] || fail "offload bench: $(cat "$tmp/out")"
awk -v a="$(field spill_gbps)" -v b="$(field restore_gbps)" 'BEGIN { exit !(a > 0 && b > 0) }' ||
  fail "offload bench rates: $(cat "$tmp/out")"
expect 2 "is required" "$bin/strata-offload-bench"
expect 2 "unknown option '--nope'" "$bin/strata-offload-bench" --dir "$tmp/spill" --nope
expect 2 "multiple of 128" "$bin/strata-offload-bench" --dir "$tmp/spill" --block-bytes 300
"$bin/strata-offload-bench" --help | grep -q -- "--block-bytes" || fail "offload bench --help"

"$bin/strata-bench-kv-pool" --slots 1000 --moves 50 >"$tmp/out" 2>"$tmp/err" || fail "kv-pool bench: $(cat "$tmp/err")"
[ -n "$(field move_us_per_block)" ] && [ "$(field slots)" = 1000 ] || fail "kv-pool bench: $(cat "$tmp/out")"
"$bin/strata-bench-device-pool" --slots 1000 --moves 50 >"$tmp/out" 2>"$tmp/err" ||
  fail "device-pool bench: $(cat "$tmp/err")"
[ -n "$(field move_us_per_step)" ] || fail "device-pool bench: $(cat "$tmp/out")"

"$bin/strata-bench-prefill" --prompt-tokens 48 --chunk 16 >"$tmp/out" 2>"$tmp/err" ||
  fail "prefill bench: $(tail -3 "$tmp/err")"
for mode in whole chunked one-by-one; do
  grep -qE "^$mode +[0-9.]+ s +[0-9.]+ tokens/s .*last logits vs whole" "$tmp/out" || fail "prefill bench lacks $mode: $(cat "$tmp/out")"
done
expect 2 "" "$bin/strata-bench-prefill" --prompt-tokens 0

"$bin/strata-bench-transport" --total-mib 8 --rtt-iters 20 --label smoke >"$tmp/out" 2>"$tmp/err" ||
  fail "transport bench: $(cat "$tmp/err")"
for what in throughput_4608B throughput_67108864B round_trip_4608B_median; do
  grep -qE "^smoke	$what	[0-9.]+	(GB/s|us)$" "$tmp/out" || fail "transport bench lacks $what: $(cat "$tmp/out")"
done
expect 2 "unknown option --nope" "$bin/strata-bench-transport" --nope
expect 2 "needs a positive integer" "$bin/strata-bench-transport" --total-mib 0
"$bin/strata-bench-transport" --help | grep -q -- "--rtt-bytes" || fail "transport bench --help"

if [ "$failures" -ne 0 ]; then
  echo "test_bench_smoke: $failures failure(s)" >&2
  exit 1
fi
echo "test_bench_smoke: ok"
