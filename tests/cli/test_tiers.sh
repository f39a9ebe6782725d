#!/usr/bin/env bash
# The KV tiers end to end on the default model: for each codec, `strata generate` with a device
# budget of about 1/8 of the sequence's KV, a small host tier and an NVMe spill directory gives
# exactly the tokens of an unconstrained run, while --stats shows blocks spilled to NVMe and
# restored; plus the errors a user meets with the tier flags and the config file.
# usage: tests/cli/test_tiers.sh PATH/TO/strata
set -uo pipefail
strata=${1:?usage: test_tiers.sh STRATA}
here=$(cd "$(dirname "$0")/../.." && pwd)
text="$here/../shared/papers/kivi.txt"
# shellcheck source=tests/cli/lib.sh
source "$(dirname "$0")/lib.sh"

[ -f "$text" ] || { echo "test_tiers: $text missing (../shared must sit beside the repository)" >&2; exit 1; }
head -c 2600 "$text" > "$tmp/prompt.txt"   # ~670 tokens: 8+ blocks per layer
gen=("$strata" generate -p - -n 8 --no-echo --stats)

# The user errors first (exit 2 with a message, or 1 for a runtime failure), no long runs.
expect 2 "holds no block" "$strata" generate -p hi --kv fp16 --device-kv-mib 0.01 --host-kv-mib 1
expect 2 "needs --nvme-dir" "$strata" generate -p hi --nvme-kv-mib 8
expect 2 "not a number" "$strata" generate -p hi --host-kv-mib lots
expect 2 "host arena: 16777216.0 MiB is more than this machine lets the process have" \
  "$strata" generate -p hi --host-kv-mib 16777216
expect 2 "holds less than one block per layer" "$strata" generate -p hi --kv fp16 --device-kv-mib 0.5
echo '{"host_kv_mib": 1, "nvme_dri": "/tmp/x"}' > "$tmp/typo.json"
expect 2 'unknown key "nvme_dri"' "$strata" generate -p hi --config "$tmp/typo.json"
echo '{"host_kv_mib": 1,' > "$tmp/broken.json"
expect 2 "broken.json: line" "$strata" generate -p hi --config "$tmp/broken.json"
echo '{"device_kv_mib": -3}' > "$tmp/neg.json"
expect 2 '"device_kv_mib" must be a number' "$strata" generate -p hi --config "$tmp/neg.json"
expect 1 "$tmp/no/such/parent" "$strata" generate -p hi -n 2 --nvme-dir "$tmp/no/such/parent/spill"
# Without a host tier a device budget below the sequence fails before the step, clearly.
expect 1 "KV block pool exhausted" "${gen[@]}" --kv kivi2 --device-kv-mib 0.3 < "$tmp/prompt.txt"
grep -q "a larger --device-kv-mib, or a tier below it" "$tmp/err" || fail "no hint after an exhausted pool: $(cat "$tmp/err")"

# mib_of FILE: the total KV MiB an unconstrained run printed with --stats
mib_of() { sed -n 's/.*(total \([0-9.]*\) MiB;.*/\1/p' "$1" | tail -1; }

# Every codec in the normal build; under the sanitizers (about 10x slower here) two that cover the
# config file and a codec with extra sections: the tier code paths they run are the same, and
# the per-codec equality is the normal build's job.
codecs="fp16 kivi2 kivi4 gear2 ott2 tada"
[ "${STRATA_SANITIZED:-0}" = 1 ] && codecs="kivi4 gear2"
for kv in $codecs; do
  "${gen[@]}" --kv "$kv" < "$tmp/prompt.txt" > "$tmp/ref.txt" 2> "$tmp/ref.err" || { fail "$kv reference: $(tail -2 "$tmp/ref.err")"; continue; }
  total=$(mib_of "$tmp/ref.err")
  device=$(python3 -c "print(round($total / 8, 3))")
  if [ "$kv" = kivi4 ]; then
    # the same budgets through the config file
    printf '{"device_kv_mib": %s, "host_kv_mib": 0.5, "nvme_dir": "%s", "nvme_kv_mib": 64}\n' "$device" "$tmp/spill" > "$tmp/tiers.json"
    tiers=(--config "$tmp/tiers.json")
  else
    tiers=(--device-kv-mib "$device" --host-kv-mib 0.5 --nvme-dir "$tmp/spill" --nvme-kv-mib 64)
  fi
  "${gen[@]}" --kv "$kv" "${tiers[@]}" < "$tmp/prompt.txt" > "$tmp/tier.txt" 2> "$tmp/tier.err" || { fail "$kv tiered: $(tail -3 "$tmp/tier.err")"; continue; }
  cmp -s "$tmp/ref.txt" "$tmp/tier.txt" || fail "$kv: tiered output differs: '$(head -c 200 "$tmp/tier.txt")' vs '$(head -c 200 "$tmp/ref.txt")'"
  spills=$(sed -n 's/^kv nvme tier: .*; \([0-9]*\) spills.*/\1/p' "$tmp/tier.err")
  restores=$(sed -n 's/^kv nvme tier: .* \([0-9]*\) restores (.*/\1/p' "$tmp/tier.err")
  crc=$(sed -n 's/^kv CRC failures: \([0-9]*\)/\1/p' "$tmp/tier.err")
  [ "${spills:-0}" -gt 0 ] && [ "${restores:-0}" -gt 0 ] || fail "$kv: --stats shows no NVMe spills/restores: $(grep '^kv ' "$tmp/tier.err")"
  [ "${crc:-x}" = 0 ] || fail "$kv: CRC failures '$crc'"
  [ -e "$tmp/spill" ] && [ -n "$(ls -A "$tmp/spill" 2>/dev/null)" ] && fail "$kv: spill files left behind"
  echo "$kv: device $device MiB of $total MiB KV: identical output; $(grep '^kv nvme tier' "$tmp/tier.err")"
done

if [ "$failures" -ne 0 ]; then
  echo "test_tiers: $failures failure(s)" >&2
  exit 1
fi
echo "test_tiers: all checks passed"
