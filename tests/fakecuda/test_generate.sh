#!/usr/bin/env bash
# `strata generate --device cuda` end to end on the fake device (tests/fakecuda/README.md): greedy
# text equal to the CPU's (one codec, and a KV plan), the device pool streaming from a host tier
# (--stats shows the traffic) and giving the text of the arena, sampling on the device reproducible
# from its seed, and an error before any work.
# usage: test_generate.sh STRATA_FAKECUDA STRATA
set -euo pipefail
fake=$1
cpu=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

# Greedy on the default model: the text equals the CPU's (fp16 weights and cache on the device;
# test_cuda_model finds every greedy pick equal over 73 steps of this model).
"$fake" generate --prompt "The capital of France is" --device cuda -n 8 --kv fp16 --no-echo >"$tmp/gpu.txt" \
  2>"$tmp/gpu.err" || fail "fake GPU generate: $(cat "$tmp/gpu.err")"
"$cpu" generate --prompt "The capital of France is" -n 8 --kv fp16 --no-echo >"$tmp/cpu.txt" 2>/dev/null \
  || fail "CPU generate"
[ -s "$tmp/gpu.txt" ] || fail "fake GPU generate printed nothing"
cmp -s "$tmp/gpu.txt" "$tmp/cpu.txt" || fail "greedy text differs: GPU '$(cat "$tmp/gpu.txt")', CPU '$(cat "$tmp/cpu.txt")'"

# A KV plan (a codec per layer range) on the device: the text equals the CPU's with the same plan.
printf '0-14:kivi4\n15-29:kivi2\n' >"$tmp/plan"
"$fake" generate --prompt "The capital of France is" --device cuda -n 8 --kv-plan "$tmp/plan" --no-echo \
  >"$tmp/gpu_plan.txt" 2>"$tmp/gpu_plan.err" || fail "fake GPU generate with a plan: $(cat "$tmp/gpu_plan.err")"
"$cpu" generate --prompt "The capital of France is" -n 8 --kv-plan "$tmp/plan" --no-echo >"$tmp/cpu_plan.txt" \
  2>/dev/null || fail "CPU generate with a plan"
cmp -s "$tmp/gpu_plan.txt" "$tmp/cpu_plan.txt" ||
  fail "greedy text with a plan differs: GPU '$(cat "$tmp/gpu_plan.txt")', CPU '$(cat "$tmp/cpu_plan.txt")'"

# The shared pool over a host tier: a device budget far below the context, --stats reports the
# blocks that moved; the text is the one without tiers (the same kernels on the same bytes).
"$fake" generate --model synthetic:tiny:seed=4 --prompt "the quick brown fox jumps over the lazy dog" \
  --device cuda -n 200 --kv kivi2 --block-tokens 32 --ctx 256 --no-echo >"$tmp/plain.txt" 2>"$tmp/plain.err" \
  || fail "fake GPU generate (arena): $(cat "$tmp/plain.err")"
"$fake" generate --model synthetic:tiny:seed=4 --prompt "the quick brown fox jumps over the lazy dog" \
  --device cuda -n 200 --kv kivi2 --block-tokens 32 --ctx 256 --device-kv-mib 0.03 --host-kv-mib 8 --stats \
  --no-echo >"$tmp/tier.txt" 2>"$tmp/tier.err" || fail "fake GPU generate (tiers): $(cat "$tmp/tier.err")"
cmp -s "$tmp/plain.txt" "$tmp/tier.txt" || fail "the text changed when the blocks went through the host tier"
grep -qE "[1-9][0-9]* moved down .* [1-9][0-9]* brought back" "$tmp/tier.err" || fail "--stats did not report the device pool's traffic: $(cat "$tmp/tier.err")"

# Sampling on the device: the same seed gives the same text.
for run in a b; do
  "$fake" generate --model synthetic:tiny:seed=4 --prompt "once upon a time" --device cuda -n 24 \
    --temperature 0.9 --top-p 0.9 --seed 1 --no-echo >"$tmp/sampled.$run" 2>"$tmp/sampled.err" \
    || fail "sampling: $(cat "$tmp/sampled.err")"
done
cmp -s "$tmp/sampled.a" "$tmp/sampled.b" || fail "one seed gave two texts"

# The errors come before any work, as on a GPU.
if "$fake" generate --model synthetic:tiny --prompt hi --device cuda --ctx 4096 --device-kv-mib 1 \
  >/dev/null 2>"$tmp/e"; then fail "a device pool without a tier below accepted"; fi
grep -q "without a tier below" "$tmp/e" || fail "unexpected message: $(cat "$tmp/e")"
# Finite weights whose logits overflow fp32: the device head fails as the CPU's does (greedy and
# sampled), instead of picking token 0 from infinities.
model=$("$cpu" --help | sed -n 's/^default model: //p')
python3 "$(dirname "$0")/../cli/gguf_fill_tensor.py" "$model" "$tmp/overflow.gguf" output_norm.weight 3e38 ||
  fail "patching output_norm.weight"
for pick in "--temperature 0" "--temperature 0.8 --top-p 0.9 --seed 3"; do
  # shellcheck disable=SC2086
  if "$fake" generate -m "$tmp/overflow.gguf" --prompt hi --device cuda -n 2 $pick >"$tmp/o" 2>"$tmp/e"; then
    fail "logits that overflow fp32 gave text ($pick): '$(cat "$tmp/o")'"
  fi
  grep -q "non-finite logit" "$tmp/e" || fail "unexpected message ($pick): $(cat "$tmp/e")"
done
rm -f "$tmp/overflow.gguf"
echo "generate_fakecuda: ok ($(wc -c <"$tmp/tier.txt") bytes through the host tier, equal to the arena's)"
