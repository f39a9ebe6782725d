#!/usr/bin/env bash
# Decode throughput and KV bytes per token for each KV codec on the default model (CPU).
# The prompt is real English text (the start of the KIVI paper in ../shared/papers), long enough
# that most of the context sits in compressed blocks; every codec generates the same number of
# tokens (--ignore-eos), one codec after the other in the same run.
# usage: bench/decode.sh [PROMPT_BYTES] [DECODE_TOKENS] [CODECS...]   (build/strata must exist)
set -euo pipefail
cd "$(dirname "$0")/.."
prompt_bytes=${1:-4000}
tokens=${2:-128}
shift 2 2>/dev/null || shift $#
codecs=("$@")
[ ${#codecs[@]} -gt 0 ] || codecs=(fp16 kivi4 kivi2)
text=../shared/papers/kivi.txt
[ -f "$text" ] || { echo "bench: $text not found (../shared must sit beside the repo)" >&2; exit 1; }
[ -x build/strata ] || { echo "bench: build/strata missing; run scripts/build.sh" >&2; exit 1; }

echo "# strata decode benchmark: $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPU cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs))"
echo "# command: bench/decode.sh $prompt_bytes $tokens ${codecs[*]}"
echo
echo "| codec | prompt tokens | prefill tok/s | decode tokens | decode tok/s | KV bytes/token (blocks) | vs fp16 | KV bytes/token (incl. fp16 tail) |"
echo "|---|---|---|---|---|---|---|---|"
for codec in "${codecs[@]}"; do
  log=$(head -c "$prompt_bytes" "$text" | build/strata generate --prompt - --no-echo --quiet --stats \
          --kv "$codec" --max-tokens "$tokens" --ignore-eos 2>&1 >/dev/null)
  prefill=$(sed -n 's/^prefill: \([0-9]*\) tokens in .* (\([0-9.]*\) tokens\/s)/\1 \2/p' <<<"$log")
  decode=$(sed -n 's/^decode:  \([0-9]*\) tokens in .* (\([0-9.]*\) tokens\/s)/\1 \2/p' <<<"$log")
  blocks=$(sed -n 's/^kv bytes\/token in blocks: \([0-9.]*\) (fp16 would be [0-9]*: \([0-9.]*\)x.*/\1 \2/p' <<<"$log")
  total=$(sed -n 's/^kv bytes\/token incl. fp16 tail: \([0-9.]*\) .*/\1/p' <<<"$log")
  read -r ptok prate <<<"$prefill"
  read -r dtok drate <<<"$decode"
  read -r bpt ratio <<<"${blocks:-n/a n/a}"
  echo "| $codec | $ptok | $prate | $dtok | $drate | $bpt | ${ratio}x | $total |"
done
