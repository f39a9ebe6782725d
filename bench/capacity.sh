#!/usr/bin/env bash
# Capacity demo: the longest sequence the default model runs with a fixed device KV budget, fp16
# vs kivi2, without and with the host + NVMe tiers. Each run generates greedily (--ignore-eos) from
# a prompt just below the predicted limit until the KV cache can take no more; strata reports the
# tokens held when the step that does not fit is refused (before it runs). With tiers the limit is
# one layer's blocks at once in the device pool; without, every layer's blocks.
# usage: bench/capacity.sh [DEVICE_MIB] [NVME_DIR]   (defaults: 1, /var/tmp/strata-capacity)
# Prints a markdown table; takes several minutes on 2 cores (long prefills).
set -uo pipefail
cd "$(dirname "$0")/.."
device=${1:-1}
nvme=${2:-/var/tmp/strata-capacity}
bin=${BIN:-build/strata}
[ -x "$bin" ] || { echo "capacity: $bin missing; build first (scripts/build.sh build)" >&2; exit 1; }
papers=../shared/papers
cat "$papers/kivi.txt" "$papers/gear.txt" > /tmp/strata-capacity-text.txt

# run CODEC TIERS PROMPT_CHARS MAX_NEW: prints "tokens|reason"
run() {
  local kv=$1 tiers=$2 chars=$3 n=$4 extra=()
  [ "$tiers" = yes ] && extra=(--host-kv-mib 4 --nvme-dir "$nvme" --nvme-kv-mib 256)
  head -c "$chars" /tmp/strata-capacity-text.txt |
    "$bin" generate -p - -n "$n" --ignore-eos --no-echo -q --stats --kv "$kv" --device-kv-mib "$device" \
      "${extra[@]}" >/dev/null 2>/tmp/strata-capacity.err
  local rc=$?
  if grep -q "stopped with" /tmp/strata-capacity.err; then
    echo "$(sed -n 's/.*stopped with \([0-9]*\) tokens.*/\1/p' /tmp/strata-capacity.err)|$(grep -m1 -o 'KV block pool exhausted\|raise the device KV budget\|KV tiers full' /tmp/strata-capacity.err)"
  elif [ $rc -ne 0 ]; then
    echo "0|$(tail -1 /tmp/strata-capacity.err | sed 's/^strata generate: //')"
  else
    echo "more than $(sed -n 's/^kv cache (.*): \([0-9.]*\) tokens.*/\1/p' /tmp/strata-capacity.err)|no limit reached"
  fi
}

echo "| device KV budget | codec | tiers below | longest sequence (tokens) | what stopped it (run time) |"
echo "|---|---|---|---|---|"
# prompt sizes (characters; ~3.9 per token in kivi.txt, ~3.1 further into the text) just below each predicted limit
for spec in "fp16 no 400 64" "kivi2 no 1000 160" "fp16 yes 4800 200" "kivi2 yes 23000 200"; do
  set -- $spec
  t0=$(date +%s)
  res=$(run "$1" "$2" "$3" "$4")
  t1=$(date +%s)
  echo "| $device MiB | $1 | $( [ "$2" = yes ] && echo "host 4 MiB + NVMe" || echo none ) | ${res%%|*} | ${res#*|} ($((t1 - t0)) s) |"
done
