#!/usr/bin/env bash
# End-to-end checks of the strata command line on the default model: eval and calibrate on a
# real text at a tiny size, their JSON and plan files, and the errors a user meets (each must be
# a clear message and exit status 2, never a crash).
# usage: tests/cli/test_cli.sh PATH/TO/strata
set -uo pipefail
strata=${1:?usage: test_cli.sh STRATA}
here=$(cd "$(dirname "$0")/../.." && pwd)
text="$here/../shared/papers/ott.txt"
# shellcheck source=tests/cli/lib.sh
source "$(dirname "$0")/lib.sh"

[ -f "$text" ] || { echo "test_cli: $text missing (../shared must sit beside the repository)" >&2; exit 1; }
head -c 6000 "$text" > "$tmp/text.txt"

# eval: errors
expect 2 "required" "$strata" eval
expect 2 "No such file" "$strata" eval --text "$tmp/none.txt"
expect 2 "unknown kv codec \"kivi3\"" "$strata" eval --text "$tmp/text.txt" --kv fp16,kivi3 -q
expect 2 "--kv: an empty list" "$strata" eval --text "$tmp/text.txt" --kv "" -q
expect 2 "needs" "$strata" eval --text "$tmp/text.txt" --prefill 5000 --tokens 4 -q
expect 2 "G=48" "$strata" eval --text "$tmp/text.txt" --kv kivi2 --kv-group 48 -q
expect 2 "layer 10 has no codec" "$strata" eval --text "$tmp/text.txt" --kv 0-9:kivi2 -q
expect 2 "is not an integer" "$strata" eval --text "$tmp/text.txt" --tokens 0
# a setting listed twice, under any spelling, is refused (it ran twice and printed the same row)
expect 2 "'kivi2' is the same setting as 'kivi2' (kivi2); list it once" "$strata" eval --text "$tmp/text.txt" --kv kivi2,kivi2 -q
expect 2 "'0-29:kivi4' is the same setting as 'kivi4'" "$strata" eval --text "$tmp/text.txt" --kv kivi4,0-29:kivi4 -q
expect 2 "'0-29:fp16' is the same setting as 'fp16' (fp16, which is always run)" "$strata" eval --text "$tmp/text.txt" --kv 0-29:fp16 -q

# eval: a tiny real run, JSON checked field by field
"$strata" eval --text "$tmp/text.txt" --prefill 260 --tokens 3 -q --json \
  --kv fp16,kivi2,0-14:kivi4,15-29:tada2,ott2,gearl2 >"$tmp/eval.json" 2>"$tmp/err" || fail "eval run: $(cat "$tmp/err")"
python3 - "$tmp/eval.json" <<'PY' || fail "eval JSON"
import json, sys
ev = json.load(open(sys.argv[1]))
assert ev["prefill"] == 260 and ev["tokens"] == 3 and ev["block_tokens"] == 64, ev
kv = [r["kv"] for r in ev["results"]]
assert kv == ["fp16", "kivi2", "0-14:kivi4,15-29:tada2", "ott2", "gearl2"], kv
fp16 = ev["results"][0]
assert fp16["kl"] == 0 and fp16["top1"] == 1 and fp16["ratio_vs_fp16"] == 1 and fp16["ppl_delta_pct"] == 0
for r in ev["results"]:
    for key in ("ppl", "ppl_delta_pct", "kl", "top1", "bytes_per_token", "total_bytes_per_token", "ratio_vs_fp16", "plan"):
        assert key in r, (r["kv"], key)
    assert len(r["k_err"]) == 30 and len(r["v_err"]) == 30
    assert r["ppl"] > 1 and 0 <= r["top1"] <= 1 and r["kl"] >= 0
k2 = ev["results"][1]
assert abs(k2["bytes_per_token"] - 9344 / 64 * 30) < 1e-6, k2["bytes_per_token"]
assert abs(k2["ratio_vs_fp16"] - 9344 / 49280) < 1e-9
assert ev["results"][3]["plan"] == "0-1:ott2-n0,2-29:ott2", ev["results"][3]["plan"]
PY

# calibrate: errors, then a tiny search whose plan generate accepts
expect 2 "required" "$strata" calibrate --text "$tmp/text.txt"
expect 2 "below the cheapest plan" "$strata" calibrate --text "$tmp/text.txt" --budget 100 --out "$tmp/p.txt" -q
expect 2 "at least two codecs" "$strata" calibrate --text "$tmp/text.txt" --budget 9000 --out "$tmp/p.txt" --candidates kivi2 -q
expect 2 "kivi2-g32 is the same codec as kivi2" "$strata" calibrate --text "$tmp/text.txt" --budget 9000 \
  --out "$tmp/p.txt" --candidates kivi2,kivi2-g32 -q
# too short a run to form one block: every codec would look free
expect 2 "forms no block of kivi2" "$strata" calibrate --text "$tmp/text.txt" --budget 9000 --out "$tmp/p.txt" \
  --candidates kivi2,kivi4 --prefill 64 --tokens 4 -q
# a budget above the most precise plan is that plan's (the search's table once grew with it)
"$strata" calibrate --text "$tmp/text.txt" --budget 1e9 --out "$tmp/big.txt" --candidates kivi2,kivi4 \
  --prefill 192 --tokens 1 -q >/dev/null 2>"$tmp/err" || fail "calibrate --budget 1e9: $(cat "$tmp/err")"
"$strata" calibrate --text "$tmp/text.txt" --budget 5000 --out "$tmp/plan.txt" --candidates kivi2,kivi4 \
  --prefill 200 --tokens 2 -q >"$tmp/cal.out" 2>"$tmp/err" || fail "calibrate run: $(cat "$tmp/err")"
grep -q "^# strata calibrate" "$tmp/plan.txt" || fail "plan file lacks its comment"
python3 - "$tmp/plan.txt" <<'PY' || fail "calibrated plan"
import sys
ranges = [l.strip() for l in open(sys.argv[1]) if l.strip() and not l.startswith("#")]
size = {"kivi2": 9344, "kivi4": 15488}
total, covered = 0, []
for r in ranges:
    layers, codec = r.split(":")
    a, _, b = layers.partition("-")
    a, b = int(a), int(b or a)
    covered += range(a, b + 1)
    total += (b - a + 1) * size[codec]
assert covered == list(range(30)), covered
assert total / 64 <= 5000, total / 64            # within the budget
assert total / 64 > 5000 - (15488 - 9344) / 64   # and no room left for one more upgrade
PY
"$strata" generate -p "The capital of France is" -n 2 -q --no-echo --kv-plan "$tmp/plan.txt" >"$tmp/out" 2>"$tmp/err" \
  || fail "generate --kv-plan: $(cat "$tmp/err")"
"$strata" generate -p "The capital of France is" -n 2 -q --no-echo --kv "$tmp/plan.txt" >"$tmp/out" 2>"$tmp/err" \
  || fail "generate --kv PLANFILE: $(cat "$tmp/err")"
expect 2 "No such file" "$strata" generate -p x --kv-plan "$tmp/none.txt" -q
echo "0-29:kivi2-g48" > "$tmp/bad.txt"
expect 2 "G=48" "$strata" generate -p x --kv-plan "$tmp/bad.txt" -q

# eval and calibrate take the KV tier flags; a run through device/host/NVMe tiers scores exactly the same
"$strata" calibrate --help | grep -q -- "--nvme-dir" || fail "calibrate --help lacks --nvme-dir"
for t in plain tiers; do
  flags=(); [ "$t" = tiers ] && flags=(--device-kv-mib 0.2 --host-kv-mib 0.25 --nvme-dir "$tmp/spill")
  "$strata" eval --text "$tmp/text.txt" --prefill 260 --tokens 3 -q --json --kv kivi2 ${flags[@]+"${flags[@]}"} \
    >"$tmp/ev-$t.json" 2>"$tmp/err" || fail "eval ($t): $(cat "$tmp/err")"
done
python3 - "$tmp/ev-plain.json" "$tmp/ev-tiers.json" <<'PY' || fail "eval with tiers differs from eval without"
import json, sys
a, b = (json.load(open(f))["results"] for f in sys.argv[1:3])
assert [[r[k] for k in ("kl", "ppl", "top1")] for r in a] == [[r[k] for k in ("kl", "ppl", "top1")] for r in b], (a, b)
assert b[1]["tier_evictions"] > 0 and b[1]["nvme_spills"] > 0, b[1]
PY
# A text whose name is no UTF-8 (jansson refuses such strings, and a refused value drops its key):
# the JSON still has "text", the byte as U+FFFD
weird="$tmp/t"$'\xff'".txt"
cp "$tmp/text.txt" "$weird"
"$strata" eval --text "$weird" --prefill 260 --tokens 1 -q --json --kv kivi2 --threads 1 >"$tmp/ev-name.json" \
  2>"$tmp/err" || fail "eval of a text named in no UTF-8: $(cat "$tmp/err")"
python3 - "$tmp/ev-name.json" <<'PY' || fail "eval JSON of a text named in no UTF-8"
import json, sys
ev = json.load(open(sys.argv[1], encoding="utf-8"))
assert ev["text"].endswith("/t\ufffd.txt"), ev.get("text")
PY
# calibrate's help says the plan found does not depend on the tiers: the search above again,
# its runs' KV through a device pool of a few blocks, host memory and NVMe
"$strata" calibrate --text "$tmp/text.txt" --budget 5000 --out "$tmp/plan-tiers.txt" --candidates kivi2,kivi4 \
  --prefill 200 --tokens 2 --device-kv-mib 0.2 --host-kv-mib 0.25 --nvme-dir "$tmp/spill" >/dev/null 2>"$tmp/err" ||
  fail "calibrate with tiers: $(cat "$tmp/err")"
cmp -s "$tmp/plan.txt" "$tmp/plan-tiers.txt" || fail "calibrate with tiers: another plan: $(diff "$tmp/plan.txt" "$tmp/plan-tiers.txt")"
grep -Eq "KV tiers over [0-9]+ runs: [1-9][0-9]* device evictions, .*NVMe: [1-9][0-9]* spills" "$tmp/err" ||
  fail "calibrate with tiers moved no block: $(cat "$tmp/err")"

# A model that rotates only part of each head with RoPE is refused, not run wrongly: the default
# model's llama.rope.dimension_count (u32 64) patched to 32 in a copy
model=$("$strata" --help | sed -n 's/^default model: //p')
python3 - "$model" "$tmp/rope32.gguf" <<'PY' || fail "patching rope.dimension_count"
import struct, sys
data = bytearray(open(sys.argv[1], "rb").read())
key = b"llama.rope.dimension_count"
at = data.find(struct.pack("<Q", len(key)) + key) + 8 + len(key)
assert at > 8 + len(key) and struct.unpack_from("<II", data, at) == (4, 64), "key not found as u32 64"
struct.pack_into("<I", data, at + 4, 32)
open(sys.argv[2], "wb").write(data)
PY
expect 1 "RoPE over 32 dimensions of each 64-dimension head" "$strata" generate -m "$tmp/rope32.gguf" -p hi -n 1
rm -f "$tmp/rope32.gguf"

# More metadata a model copy may lie about: an infinite epsilon, a block_count below the file's
# layers (a truncated model would run), a name with a control character (shown as '?').
patch_model() {  # patch_model KEY STRUCT_FORMAT VALUE [OFFSET]: the key's value (after its type) set
  python3 - "$model" "$tmp/patched.gguf" "$@" <<'PY' || fail "patching $1"
import struct, sys
src, dst, key, fmt, value = sys.argv[1:6]
off = int(sys.argv[6]) if len(sys.argv) > 6 else 0
data = bytearray(open(src, "rb").read())
k = key.encode()
at = data.find(struct.pack("<Q", len(k)) + k) + 8 + len(k) + 4 + off
assert at > 8 + len(k) + 4
struct.pack_into(fmt, data, at, float(value) if "f" in fmt else int(value))
open(dst, "wb").write(data)
PY
}
patch_model llama.attention.layer_norm_rms_epsilon "<f" inf
expect 1 "must be finite and positive" "$strata" generate -m "$tmp/patched.gguf" -p hi -n 1
patch_model llama.block_count "<I" 29
expect 1 "tensor blk.29.* belongs to layer 29, but llama.block_count is 29" "$strata" generate -m "$tmp/patched.gguf" -p hi -n 1
patch_model general.name "<B" 27 8   # the first byte of the name string becomes ESC
"$strata" generate -m "$tmp/patched.gguf" -p hi -n 1 --no-echo >/dev/null 2>"$tmp/err" || fail "ESC in the name: $(cat "$tmp/err")"
grep -q "^strata: ?mollm2 " "$tmp/err" || fail "the model name's control character reached the terminal: $(grep -a mollm2 "$tmp/err" | od -c | head -3)"
rm -f "$tmp/patched.gguf"
# Finite weights whose logits overflow fp32 (output_norm.weight all 3e38): an error, not token 0.
python3 "$(dirname "$0")/gguf_fill_tensor.py" "$model" "$tmp/patched.gguf" output_norm.weight 3e38 ||
  fail "patching output_norm.weight"
expect 1 "non-finite logit" "$strata" generate -m "$tmp/patched.gguf" -p hi -n 2
expect 1 "non-finite logit" "$strata" eval -m "$tmp/patched.gguf" --text "$tmp/text.txt" --prefill 64 --tokens 2 -q
rm -f "$tmp/patched.gguf"

# Files that are not what they should be: refused at once with the reason, never waited on
mkfifo "$tmp/fifo"
expect 1 "not a regular file" timeout 20 "$strata" inspect "$tmp/fifo"
expect 2 "^strata inspect: $tmp/none.kv: No such file or directory" "$strata" inspect "$tmp/none.kv"
expect 2 "^strata inspect: $tmp: is a directory" "$strata" inspect "$tmp"
expect 1 "not a GGUF file (not a regular file)" timeout 20 "$strata" generate -m "$tmp/fifo" -p hi
truncate -s 4G "$tmp/sparse.kv"
expect 1 "not a block file (bad magic)" timeout 20 "$strata" inspect "$tmp/sparse.kv"
rm -f "$tmp/sparse.kv" "$tmp/fifo"
expect 2 "a NUL byte at byte 5" "$strata" eval --text <(printf 'hello\0world') -q
expect 2 "invalid UTF-8 at byte 3" "$strata" calibrate --text <(printf 'abc\xff') --budget 5000 --out "$tmp/p.txt" -q
printf '# only a comment\n\n' >"$tmp/empty-plan.txt"
expect 2 "holds no plan" "$strata" generate -p hi --kv-plan "$tmp/empty-plan.txt"
expect 2 "Is a directory" "$strata" generate -p hi --kv-plan "$tmp"
expect 2 "Is a directory" "$strata" eval --text "$tmp"

# eval: a run too short to form a block says so instead of showing 0 bytes as a result
"$strata" eval --text "$tmp/text.txt" --prefill 64 --tokens 4 --kv kivi2 -q >"$tmp/out" 2>"$tmp/err" ||
  fail "short eval: $(tail -2 "$tmp/err")"
grep -q "note: kivi2 formed no block" "$tmp/out" || fail "short eval printed no note: $(head -5 "$tmp/out")"

# generate: --ctx bounds prompt + generated tokens (as the server's context does)
expect 0 "finish:  length after 3 tokens" "$strata" generate -p "hello there" --ctx 5 -n 10 --ignore-eos --stats
grep -q "prompt 2 tokens, context 5" "$tmp/err" || fail "generate --ctx 5: $(head -1 "$tmp/err")"
expect 0 "warning: --ctx 9000 is beyond the model's trained context of 8192" "$strata" generate -p hi -n 1 --ctx 9000 -q

# Output that cannot be written is a failure with a message, not exit 0 with the text lost; a
# reader that leaves (| head) is not an error.
to_full() { "$@" >/dev/full; }
expect 1 "writing to standard output failed" to_full "$strata" generate -p hi -n 3 -q --ignore-eos
expect 1 "writing to standard output failed" to_full "$strata" eval --text "$tmp/text.txt" --prefill 64 --tokens 2 --kv kivi2 -q
"$strata" help help >"$tmp/out" 2>"$tmp/err" && grep -q "^usage: strata <command>" "$tmp/out" ||
  fail "strata help help: $(cat "$tmp/err")"
# The shape flags are what a failing check is about: named, not a "layer 0" of --kv.
expect 2 "--kv kivi4 with --kv-group 7: kivi4-g7 codec: group G=7" "$strata" generate -p hi -n 1 --kv-group 7
grep -q "layer 0" "$tmp/err" && fail "--kv-group 7 blamed layer 0: $(cat "$tmp/err")"
# eval --kv-plan belongs to the setting 'tada'; without it in --kv it was silently unused.
expect 2 "is the plan of the setting 'tada'" "$strata" eval --text "$tmp/text.txt" --kv kivi4 --kv-plan "$tmp/plan.txt" -q
# Two range lists in a row are two settings; long plan names are printed whole (a 256-byte buffer
# cut them mid-name).
long=0-0:gear4-g16-r96-i2; for l in $(seq 1 29); do long+=",$l-$l:gear$((l % 2 * 2 + 2))-g16-r96-i2"; done
"$strata" eval --text "$tmp/text.txt" --prefill 64 --tokens 2 -q --json --kv "0-14:kivi4,15-29:kivi2,0-29:kivi4,$long" \
  >"$tmp/out" 2>"$tmp/err" || fail "eval of range lists: $(tail -2 "$tmp/err")"
python3 - "$tmp/out" <<'PY' || fail "eval of range lists: $(cat "$tmp/out")"
import json, sys
r = json.load(open(sys.argv[1]))["results"]
assert [x["kv"] for x in r][1:3] == ["0-14:kivi4,15-29:kivi2", "0-29:kivi4"], [x["kv"] for x in r]
assert r[3]["plan"].endswith(",28:gear2-g16-r96-i2,29:gear4-g16-r96-i2") and len(r[3]["plan"]) > 512, r[3]["plan"]
PY
expect 0 "kv cache (0-1:gear4-g16-r96-i2,.*,29:gear4-g16-r96-i2, 30 layers)" "$strata" generate -p hi -n 2 --kv "$long" --stats --no-echo

# A long prefill reports its progress (it takes minutes on a CPU; nothing showed before), not with -q.
head -c 5000 "$here/docs/decisions.md" >"$tmp/long.txt"
expect 0 "strata: prefill of [0-9]* tokens: 100% (30 of 30 layers)" "$strata" generate -p - -n 1 --no-echo <"$tmp/long.txt"
"$strata" generate -p - -n 1 --no-echo -q <"$tmp/long.txt" >/dev/null 2>"$tmp/err"
grep -q "prefill of" "$tmp/err" && fail "-q printed prefill progress"

# A mistyped plan file's path is a missing file, not an unknown codec.
expect 2 "--kv $tmp/no-such-plan.txt: no such plan file" "$strata" generate -p hi -n 1 --kv "$tmp/no-such-plan.txt"

# eval out of KV room says which flags give it more, as generate does.
expect 1 "give the KV cache more room: a larger --device-kv-mib, or a tier below it" \
  "$strata" eval --text "$tmp/text.txt" --prefill 200 --tokens 2 --kv kivi2 --device-kv-mib 0.5 -q

[ "$failures" -eq 0 ] && echo "test_cli: all checks passed"
exit $((failures > 0))
