#!/usr/bin/env bash
# Quality of every KV codec against the fp16 cache on the default model (docs/quality.md):
# runs `strata eval` once (all settings side by side, same prefill, same tokens), then writes
#   OUT.json   the eval's JSON
#   OUT.md     a markdown table (and the per-layer errors)
#   OUT.png    quality loss (KL vs fp16) against bytes per token, one point per setting (gnuplot)
# usage: bench/quality.sh [OUT]   (default docs/quality-data); environment: TEXT PREFILL TOKENS KV PLAN
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/quality-data}
text=${TEXT:-../shared/papers/kivi.txt}
prefill=${PREFILL:-1024}
tokens=${TOKENS:-512}
kv=${KV:-fp16,kivi2,kivi4,gear2,gearl2,ott2,tada,kivi4-g8}
[ -f "$text" ] || { echo "bench: $text not found (../shared must sit beside the repo)" >&2; exit 1; }
[ -x build/strata ] || { echo "bench: build/strata missing; run scripts/build.sh" >&2; exit 1; }
if ! command -v gnuplot >/dev/null; then
  echo "bench: installing gnuplot-nox for the plot" >&2
  sudo_cmd=""; [ "$(id -u)" -eq 0 ] || sudo_cmd=sudo
  $sudo_cmd apt-get install -y -qq gnuplot-nox >/dev/null
fi
plan_args=()
[ -n "${PLAN:-}" ] && plan_args=(--kv-plan "$PLAN")
cmd=(build/strata eval --text "$text" --kv "$kv" --prefill "$prefill" --tokens "$tokens" "${plan_args[@]}" --json)
echo "bench: ${cmd[*]}" >&2
"${cmd[@]}" > "$out.json"
python3 bench/quality_report.py "$out.json" "$out.dat" "${cmd[*]}" > "$out.md"
gnuplot <<GP
set terminal pngcairo size 900,560 noenhanced
set output "$out.png"
set title "KV cache quality vs size: $(basename "$text"), prefill $prefill, $tokens decode steps (SmolLM2-135M)"
set xlabel "KV bytes per token (blocks, summed over 30 layers)"
set ylabel "mean KL(fp16 || codec), nats (log scale)"
set logscale y
set grid
set key off
set offsets graph 0.05, graph 0.12, graph 0.1, graph 0.1
plot "$out.dat" using 2:3 with points pt 7 ps 1.5, "" using 2:3:1 with labels offset 1,0.8 left
GP
echo "bench: wrote $out.json $out.md $out.png" >&2
