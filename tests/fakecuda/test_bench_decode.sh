#!/usr/bin/env bash
# strata-bench-decode-gpu's own code on the fake device (tests/fakecuda/README.md): the batch that
# fits the budget, prefill and decode through the GPU forward pass, the table, --phases (each
# phase counted as often as the steps ran it) and --json, and its option errors. The times it
# prints are the emulation's, not a GPU's.
# usage: test_bench_decode.sh STRATA_BENCH_DECODE_GPU_FAKECUDA
set -euo pipefail
bench=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

"$bench" --model synthetic:tiny:seed=3 --codecs fp16,kivi2 --kv-budget-gib 1 --max-batch 3 --prefill-batch 2 \
  --prompt 80 --gen 4 --phases --json "$tmp/out.json" >"$tmp/out.txt" 2>"$tmp/err.txt" \
  || fail "the benchmark failed: $(cat "$tmp/err.txt")"
cat "$tmp/out.txt"
grep -Eq '^fp16 +3 ' "$tmp/out.txt" || fail "no fp16 row with a batch of 3"
grep -Eq '^kivi2 +3 .* [0-9.]+x$' "$tmp/out.txt" || fail "no kivi2 row with its ratio to fp16"
for phase in input qkv decode_attn prefill_attn kv_append prompt_blocks mlp head; do
  grep -Eq "^  $phase " "$tmp/out.txt" || fail "the phase table has no row '$phase'"
done

python3 - "$tmp/out.json" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
assert [r["codec"] for r in rows] == ["fp16", "kivi2"], rows
for r in rows:
    pf, dc = r["prefill_phases"], r["decode_phases"]
    layers = dc["qkv"][2] // dc["steps"]
    assert layers >= 1, dc
    assert pf["steps"] == 2, pf                      # 3 prompts, 2 a step
    assert dc["steps"] == 4, dc                      # --gen 4: one step a token
    assert pf["prefill_attn"][2] == 3 * layers, pf   # every prompt, every layer
    assert pf["decode_attn"][2] == 0 and dc["prefill_attn"][2] == 0
    assert dc["decode_attn"][2] == 4 * layers, dc
    assert dc["head"][2] == 4 and dc["input"][2] == 4, dc
    assert pf["dropped_steps"] == 0 and dc["dropped_steps"] == 0, (pf, dc)
    for name, value in list(pf.items()) + list(dc.items()):
        if name not in ("steps", "dropped_steps"):
            device, host, _ = value
            assert device >= 0 and host >= 0, (name, device, host)
    assert sum(v[0] for k, v in dc.items() if k not in ("steps", "dropped_steps")) > 0
    assert r["decode_tok_s"] > 0 and r["batch"] == 3
PY

# Option errors: a message and exit status 2, before any work.
for bad in "--gen 0" "--weights f8" "--kv-budget-gib x" "--phases extra"; do
  set +e
  # shellcheck disable=SC2086
  "$bench" $bad >/dev/null 2>"$tmp/bad.txt"
  status=$?
  set -e
  [ "$status" -eq 2 ] || fail "'$bad' exited $status, not 2"
  [ -s "$tmp/bad.txt" ] || fail "'$bad' gave no message"
done
echo "bench_decode_fakecuda: ok"
