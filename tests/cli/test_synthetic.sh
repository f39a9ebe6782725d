#!/usr/bin/env bash
# `strata generate` on synthetic models (no model file needed): a tiny shape generates, the same
# seed gives the same text and another seed other text, and the errors a user meets (unknown
# shape, malformed spec, a shape too large for the memory) are clear messages with exit status 1.
# The usage errors strata generate, strata serve, strata-coordinator and strata-worker give before
# starting anything (exit 2).
# Served too: `strata serve --model synthetic:tiny:seed=4` (two pipeline stages, each worker
# generating only its layers) answers `strata generate --server` with the local program's text
# (the API's text is UTF-8, so bytes that are not, which random weights produce, arrive as U+FFFD:
# the local text is compared after the same replacement).
# usage: tests/cli/test_synthetic.sh PATH/TO/strata
set -uo pipefail
strata=${1:?usage: test_synthetic.sh STRATA}
# shellcheck source=tests/cli/lib.sh
source "$(dirname "$0")/lib.sh"

expect 0 "synthetic tiny seed 1, 4 layers" "$strata" generate --model synthetic:tiny --prompt hi --max-tokens 8 --stats
grep -q "^decode:" "$tmp/err" || fail "generate --stats on synthetic:tiny printed no decode line"
grep -q "length after 8 tokens" "$tmp/err" || fail "synthetic:tiny did not run its 8 tokens: $(tail -3 "$tmp/err")"
head -c 2 "$tmp/out" | grep -q "^hi$" || fail "the prompt is not echoed: $(head -c 80 "$tmp/out")"
cp "$tmp/out" "$tmp/seed1.txt"
expect 0 "loading synthetic:tiny:seed=1" "$strata" generate --model synthetic:tiny:seed=1 --prompt hi --max-tokens 8
cmp -s "$tmp/out" "$tmp/seed1.txt" || fail "synthetic:tiny and synthetic:tiny:seed=1 differ"
expect 0 "synthetic tiny seed 2" "$strata" generate --model synthetic:tiny:seed=2 --prompt hi --max-tokens 8 --stats
cmp -s "$tmp/out" "$tmp/seed1.txt" && fail "seeds 1 and 2 gave the same text"
expect 0 "synthetic tiny" env STRATA_MODEL=synthetic:tiny "$strata" generate --prompt hi --max-tokens 2 --stats

# Unused and unknown tokens are not text: the random weights sample "<|unused_N|>" placeholders,
# which were printed into the continuation.
"$strata" generate --model synthetic:tiny --prompt hi --max-tokens 64 --no-echo -q >"$tmp/out" 2>"$tmp/err" ||
  fail "synthetic:tiny, 64 tokens: $(tail -2 "$tmp/err")"
grep -q "<|unused_" "$tmp/out" && fail "unused tokens printed as text: $(head -c 120 "$tmp/out")"

# A --model that names no model is bad usage (exit 2, as strata serve has it), found before loading.
expect 2 "known: tiny, smollm2-135m" "$strata" generate --model synthetic:llama9 --prompt hi
expect 2 "seed is not a decimal integer" "$strata" generate --model synthetic:tiny:seed=-3 --prompt hi
expect 2 "only ':seed=N' may follow" "$strata" generate --model synthetic:tiny:x --prompt hi
expect 2 "^strata generate: model $tmp/none.gguf: No such file or directory" "$strata" generate --model "$tmp/none.gguf" -p hi
expect 2 "^strata eval: model $tmp: is a directory, not a GGUF file" "$strata" eval --model "$tmp" --text "$0"
expect 2 "^strata calibrate: unknown synthetic model shape 'x'" "$strata" calibrate --model synthetic:x --text "$0" \
  --budget 1000 --out "$tmp/never.plan"
expect 1 "need 29.92 GiB of fp32 weights, but only 4.00 GiB" \
  env STRATA_SYNTHETIC_MEM_LIMIT=4G "$strata" generate --model synthetic:llama3-8b --prompt hi
# strata generate's own usage errors (exit 2), each before anything loads.
gen_bad() { expect 2 "$1" "$strata" generate --model synthetic:tiny "${@:2}"; }
gen_bad "^strata: --top-k: '-1' is not an integer in \[0, 16777216\]" -p hi --top-k -1
gen_bad "^strata: --stop needs a non-empty string" -p hi --stop ""
stops=(); for s in {a..q}; do stops+=(--stop "$s"); done
gen_bad "^strata: at most 16 --stop strings" -p hi "${stops[@]}"
gen_bad "^strata: --device cuda:N: 'x' is not an integer in \[0, 1023\]" -p hi --device cuda:x
gen_bad "^strata generate: unexpected argument 'extra' (the prompt goes after --prompt)" -p hi extra
gen_bad "^strata generate: --prompt is required" --max-tokens 2
gen_bad "^strata generate: --token-file and --tls-ca go with --server" -p hi --token-file "$tmp/none"
gen_bad "^strata generate: the prompt is empty" -p ""
gen_bad "^strata generate: --system only applies with --chat" -p hi --system "be brief"
gen_bad "^strata generate: the prompt has 1801 tokens but the context holds 64 (raise --ctx)" \
  -p "$(printf 'hi %.0s' {1..600})" --ctx 64
gen_bad "^strata generate: --save-kv $tmp/none/x.kv: its folder does not exist" -p hi --save-kv "$tmp/none/x.kv"
expect 2 "^strata generate: --ctx does not apply with --server" "$strata" generate --server 127.0.0.1:1 -p hi --ctx 64

# A configuration the coordinator refuses: a message and exit status 2, never a crash (these once
# segfaulted tearing down the half-made coordinator).
serve_bad() { expect 2 "$1" timeout 60 "$strata" serve --listen 127.0.0.1:0 --model synthetic:tiny:seed=4 "${@:2}"; }
serve_bad 'unknown kv codec "nosuch"' --kv nosuch
printf '# a plan file as calibrate writes one\n0-1:kivi2\n2-3:nosuch\n' >"$tmp/bad.plan"
serve_bad "KV plan: $tmp/bad.plan: kv plan line 3: unknown kv codec \"nosuch\"" --kv "$tmp/bad.plan"
serve_bad "--kv-codecs 'nosuch': unknown kv codec" --kv-codecs "fp16, nosuch"
serve_bad "--kv-codecs '0-1:kivi2': kv plan: layer 2 has no codec" --kv-codecs "fp16;0-1:kivi2"
serve_bad "5 stages for a model of 4 layers" --stages 5
serve_bad "coordinator: --stage-layers: the layer counts add up to 6, but the model has 4 layers" --stage-layers 3,3
serve_bad "--stage-layers 3,1 names 2 stages, but --stages is 3" --stage-layers 3,1 --stages 3
echo '{"stages": 1}' >"$tmp/one-stage.json"
serve_bad "--stage-layers 3,1 names 2 stages, but --stages is 1" --stage-layers 3,1 --config "$tmp/one-stage.json"
serve_bad "--stage-layers: '4,0': every stage needs at least 1 layer" --stage-layers 4,0
serve_bad "--stage-layers: 'uneven': expected even, balanced or layer counts" --stage-layers uneven
serve_bad "5 stages for a model of 4 layers" --stage-layers 1,1,1,1,1
serve_bad "worker binary $tmp is not a file" --worker-bin "$tmp"
serve_bad "the KV of 2 local workers (2 x (256 + 16000000 MiB of --device-kv-mib and --host-kv-mib)): 32000512.0 MiB is more than" --host-kv-mib 16000000
serve_bad "does not divide block_tokens 7" --block-tokens 7
serve_bad "exceeds max batch tokens 50" --max-seqs 100 --max-batch-tokens 50
serve_bad "steps-in-flight: '0' is not an integer in \[1, 64\]" --steps-in-flight 0
serve_bad "device-kv-mib: '0' is not a number in \[0.00390625, 16777216\]" --device-kv-mib 0
serve_bad "port in 0..65535" --listen 127.0.0.1:99999
# A worker that cannot start (here its spill file's name is taken by a user's file) fails the
# start after its second exit, with its own message, instead of restarting until the timeout;
# the message names it, not its pipeline partner (which the coordinator lets go, status 0).
mkdir -p "$tmp/spill/local-1" && chmod 700 "$tmp/spill" "$tmp/spill/local-1"
echo "a user's notes" >"$tmp/spill/local-1/slab-0000.kv"
SECONDS=0
expect 1 "worker local-1 exited 2 times before the server was ready (last: status 1); giving up" \
  timeout 120 "$strata" serve --listen 127.0.0.1:0 --model synthetic:tiny:seed=4 --host-kv-mib 1 --nvme-kv-mib 4 \
  --nvme-dir "$tmp/spill" --ready-timeout 100
[ "$SECONDS" -lt 60 ] || fail "serve took $SECONDS s to give up on a worker that cannot start"
grep -q "does not look like a slab file" "$tmp/err" || fail "the worker's reason is not in serve's output"
grep -q "a user's notes" "$tmp/spill/local-1/slab-0000.kv" || fail "the user's file was overwritten"
expect 2 "port in 1..65535" "$strata" generate --server 127.0.0.1 --prompt hi
# Prompts and flags refused before any work: the bytes the server would refuse, two settings of
# the same thing, output paths that could not be written after a long run.
syn=("$strata" generate --model synthetic:tiny:seed=4 -n 1 -q)
expect 2 "the prompt read from stdin contains a NUL byte" bash -c 'printf "ab\0cd" | "$@"' _ "${syn[@]}" -p -
expect 2 "the prompt read from stdin is empty" bash -c ': | "$@"' _ "${syn[@]}" -p -
expect 2 "the prompt read from stdin is over 64 MiB" bash -c 'head -c 70000000 /dev/zero | tr "\\0" a | "$@"' _ "${syn[@]}" -p -
expect 2 "reading the prompt from stdin: Is a directory" bash -c 'dir=$1; shift; "$@" < "$dir"' _ "$tmp" "${syn[@]}" -p -
expect 2 "the prompt is not valid UTF-8" "${syn[@]}" -p $'\xc3\x28'
expect 2 "the prompt is not valid UTF-8" bash -c 'printf "\xff" | "$@"' _ "${syn[@]}" -p -
"${syn[@]}" -p "é ü" --no-echo >/dev/null 2>"$tmp/err" || fail "a UTF-8 prompt: $(cat "$tmp/err")"
for p in 0 2 -0.5 nan 1e-50 0.5x; do   # one message for the interval, open at 0 (1e-50 is 0 as a float)
  expect 2 "^strata: --top-p: '$p' is not a number in (0, 1\]" "${syn[@]}" -p hi --top-p "$p"
done
expect 2 "--kv and --kv-plan both set the KV codecs" "${syn[@]}" -p hi --kv kivi2 --kv-plan "$tmp/plan.txt"
expect 2 "--save-kv $tmp/none/kv.bin: its folder does not exist" "${syn[@]}" -p hi --save-kv "$tmp/none/kv.bin"
expect 2 "--save-kv $tmp: is a folder" "${syn[@]}" -p hi --save-kv "$tmp"
mkfifo "$tmp/fifo"   # never replaced: a device or FIFO at the path is the user's
expect 2 "--save-kv $tmp/fifo: exists and is not a regular file" "${syn[@]}" -p hi --save-kv "$tmp/fifo"
[[ -p $tmp/fifo ]] || { echo "test_synthetic: the FIFO at --save-kv's path is gone"; exit 1; }
ln -s none "$tmp/dangling"
expect 2 "--save-kv $tmp/dangling: is a symbolic link to nothing" "${syn[@]}" -p hi --save-kv "$tmp/dangling"
expect 2 "--out $tmp/none/p.txt: its folder does not exist" "$strata" calibrate --text "$tmp/x" --budget 9 \
  --out "$tmp/none/p.txt"
expect 2 "--chat does not apply with --server" "$strata" generate --server 127.0.0.1:1 --chat -p hi
head -c 1100000 /dev/zero | tr '\0' a >"$tmp/big.txt"   # over strata.proto's 1 MiB of text: told before sending
expect 2 "input.text is 1100000 bytes, at most 1048576 are allowed" bash -c 'f=$1; shift; "$@" < "$f"' _ \
  "$tmp/big.txt" "$strata" generate --server 127.0.0.1:1 -p -
# Token and secret files: each message names the command that read it; a folder or an empty file
# is not a token.
: >"$tmp/empty-token"
expect 2 "^strata drain: --token-file $tmp/none: No such file" "$strata" drain --server 127.0.0.1:1 \
  --token-file "$tmp/none" w0
expect 2 "^strata generate: --token-file $tmp: Is a directory" "$strata" generate --server 127.0.0.1:1 \
  --token-file "$tmp" -p hi
expect 2 "--token-file $tmp/empty-token is empty" "$strata" generate --server 127.0.0.1:1 \
  --token-file "$tmp/empty-token" -p hi
printf 'not a certificate\n' >"$tmp/ca.txt"
expect 2 "^strata generate: --tls-ca $tmp/ca.txt holds no valid PEM certificate" "$strata" generate \
  --server 127.0.0.1:1 --tls-ca "$tmp/ca.txt" -p hi
printf -- '-----BEGIN CERTIFICATE-----\nZ2FyYmFnZQ==\n-----END CERTIFICATE-----\n' >"$tmp/ca.pem"   # the look, not a certificate
expect 2 "^strata generate: --tls-ca $tmp/ca.pem holds no valid PEM certificate" "$strata" generate \
  --server 127.0.0.1:1 --tls-ca "$tmp/ca.pem" -p hi
serve_bad "--token-file $tmp: Is a directory" --token-file "$tmp"
serve_bad "--secret-file $tmp/none: No such file" --secret-file "$tmp/none"
# "strata help CMD" is that command's --help
"$strata" help generate >"$tmp/out" 2>&1 || fail "strata help generate exited $?"
grep -q "^usage: strata generate" "$tmp/out" || fail "strata help generate: $(head -1 "$tmp/out")"
expect 2 "unknown command 'nosuch'" "$strata" help nosuch
# The same from --config: integers reach string options too (the text they become outlives the
# parsing: ASan checks), "quiet" takes a boolean.
printf '{"block_tokens": 7, "max_seqs": 4}' >"$tmp/block.json"
serve_bad "does not divide block_tokens 7" --config "$tmp/block.json"
printf '{"quiet": 1}' >"$tmp/quiet.json"
serve_bad "key 'quiet' must be true or false" --config "$tmp/quiet.json"
serve_bad "is a directory, not a config file" --config "$tmp"
serve_bad "config $tmp/none.json: unable to open" --config "$tmp/none.json"
printf '{"max_seqs": 4, "max-seqs": 8}' >"$tmp/twice.json"
serve_bad "key 'max-seqs' sets --max-seqs a second time" --config "$tmp/twice.json"
serve_bad "--nvme-dir $tmp/twice.json: not a folder" --host-kv-mib 1 --nvme-kv-mib 8 --nvme-dir "$tmp/twice.json"
# The rest of what serve refuses before it starts anything: each names the file, key or flag.
printf '{"stages": 2,\n "replicas": }\n' >"$tmp/syntax.json"
serve_bad "config $tmp/syntax.json: line 2: " --config "$tmp/syntax.json"
printf '[1, 2]' >"$tmp/array.json"
serve_bad "config $tmp/array.json: the top level must be a JSON object" --config "$tmp/array.json"
printf '{"stagse": 2}' >"$tmp/typo.json"
serve_bad "config $tmp/typo.json: unknown key 'stagse'" --config "$tmp/typo.json"
printf '{"stages": [2]}' >"$tmp/list.json"
serve_bad "config $tmp/list.json: key 'stages' must be a string or a number" --config "$tmp/list.json"
# The same from YAML (a name ending in .yaml or .yml): its values reach the options, its
# errors name their line
printf 'block_tokens: 7   # no divisor\nmax_seqs: 4\n' >"$tmp/block.yaml"
serve_bad "does not divide block_tokens 7" --config "$tmp/block.yaml"
printf 'stages: 2\nstagse: 2\n' >"$tmp/typo.yaml"
serve_bad "config $tmp/typo.yaml: unknown key 'stagse'" --config "$tmp/typo.yaml"
printf 'stages: 2\nstages: 3\n' >"$tmp/dup.yml"
serve_bad "config $tmp/dup.yml: line 2: duplicate key 'stages'" --config "$tmp/dup.yml"
printf -- '- stages\n' >"$tmp/list.yaml"
serve_bad "config $tmp/list.yaml: the top level must be a mapping of option names" --config "$tmp/list.yaml"
printf 'stages:\n  - 2\n' >"$tmp/seq.yaml"
serve_bad "config $tmp/seq.yaml: key 'stages' must be a string or a number" --config "$tmp/seq.yaml"
printf 'quiet: yes\n' >"$tmp/yes.yaml"
serve_bad "key 'quiet' must be true or false" --config "$tmp/yes.yaml"
serve_bad "--config given twice" --config "$tmp/one-stage.json" --config "$tmp/one-stage.json"
serve_bad "unexpected argument 'extra' (try --help)" extra
serve_bad "--tls-cert and --tls-key go together" --tls-cert "$tmp/one-stage.json"
serve_bad "--nvme-kv-mib needs --host-kv-mib" --nvme-kv-mib 8 --nvme-dir "$tmp/spill"
serve_bad "--nvme-kv-mib and --nvme-dir go together" --host-kv-mib 1 --nvme-kv-mib 8
serve_bad "65 local workers; at most 64" --replicas 65 --stages 1
: >"$tmp/empty-token"
serve_bad "--token-file $tmp/empty-token is empty" --token-file "$tmp/empty-token"
expect 2 "--secret-file is required" timeout 60 "$(dirname "$strata")/strata-coordinator" --listen 127.0.0.1:0 \
  --model synthetic:tiny
expect 2 "config $tmp/none.json: unable to open" "$strata" generate --model synthetic:tiny -p hi --config "$tmp/none.json"
expect 2 "config $tmp: is a directory, not a config file" "$strata" generate --model synthetic:tiny -p hi --config "$tmp"
printf '{"metrics": 9, "quiet": true}' >"$tmp/metrics.json"
expect 2 "metrics address '9': expected HOST:PORT" \
  timeout 60 "$strata" serve --listen 127.0.0.1:0 --model synthetic:tiny:seed=4 --config "$tmp/metrics.json"
expect 1 "STRATA_SYNTHETIC_MEM_LIMIT='lots' is not a byte count" \
  env STRATA_SYNTHETIC_MEM_LIMIT=lots "$strata" generate --model synthetic:tiny --prompt hi

# --device: bad values are usage errors; cuda without a GPU (or in a build without CUDA) fails
# with a message before anything is printed; KV plans the GPU path cannot hold are refused first.
expect 2 "takes cpu, cuda or cuda:N" "$strata" generate --model synthetic:tiny --prompt hi --device gpu
expect 2 "save-kv does not apply with --device cuda" "$strata" generate --model synthetic:tiny --prompt hi \
  --device cuda --save-kv "$tmp/kv.bin"
"$strata" generate --model synthetic:tiny --prompt hi --device cuda -n 1 >/dev/null 2>"$tmp/probe"
if grep -q "no CUDA support" "$tmp/probe"; then
  echo "test_synthetic: this build has no CUDA: --device cuda checked for its message only"
  expect 1 "no CUDA support" "$strata" generate --model synthetic:tiny --prompt hi --device cuda
else
  printf '0-1:kivi2\n2-3:fp16\n' >"$tmp/mixed.plan"   # the GPU path needs one fp16 window for all layers
  expect 2 "share it" "$strata" generate --model synthetic:tiny --prompt hi --device cuda --kv-plan "$tmp/mixed.plan"
  # A device pool too small for one layer's blocks of the context, with and without a tier below.
  expect 2 "at once (one layer's blocks" "$strata" generate --model synthetic:tiny --prompt hi --device cuda \
    --ctx 4096 --device-kv-mib 0.05 --host-kv-mib 8
  expect 2 "without a tier below" "$strata" generate --model synthetic:tiny --prompt hi --device cuda \
    --ctx 4096 --device-kv-mib 1
fi
if grep -q "no CUDA support" "$tmp/probe"; then
  :
elif nvidia-smi -L >/dev/null 2>&1; then
  expect 0 "cuda:0" "$strata" generate --model synthetic:tiny --prompt hi --device cuda -n 8
else
  expect 1 "no CUDA device" "$strata" generate --model synthetic:tiny --prompt hi --device cuda -n 8
  [ -s "$tmp/out" ] && fail "--device cuda without a GPU printed to stdout: $(head -c 80 "$tmp/out")"
fi

# strata-worker --device: a bad value is a usage error; cuda without a device (or CUDA in the
# build) fails before joining, with the reason.
worker="$(dirname "$strata")/strata-worker"
printf 'a cluster secret of 32 bytes....' >"$tmp/secret"
expect 2 "takes cpu, cuda or cuda:N" "$worker" --coordinator 127.0.0.1:1 --secret-file "$tmp/secret" --device gpu
expect 2 "--nvme-dir $tmp/secret: not a folder" "$worker" --coordinator 127.0.0.1:1 --secret-file "$tmp/secret" --nvme-dir "$tmp/secret"
# The secret's length as both programs count it: 256 bytes and a newline is a 256-byte secret.
{ head -c 256 /dev/zero | tr '\0' s; echo; } >"$tmp/secret256"
head -c 257 /dev/zero | tr '\0' s >"$tmp/secret257"
expect 1 "cannot reach the coordinator" "$worker" --coordinator 127.0.0.1:1 --secret-file "$tmp/secret256" \
  --connect-timeout-ms 200
expect 2 "must be 16 to 256 bytes .* it has 257" "$worker" --coordinator 127.0.0.1:1 --secret-file "$tmp/secret257"
# Stopped while it waits for a coordinator that is not there: it leaves at once, not after
# --connect-timeout-ms (a launcher or systemd stopping it would wait that long, then kill it).
for sig in TERM HUP; do
  "$worker" --coordinator 127.0.0.1:1 --secret-file "$tmp/secret" --connect-timeout-ms 60000 2>"$tmp/wait.err" &
  waiting=$!
  # Signalled once its handlers are in (SIGHUP's, the last installed, shows in SigCgt's bit 0):
  # before that the signal's default action would end it without a word.
  for _ in $(seq 100); do
    caught=$(awk '/^SigCgt/ {print $2}' "/proc/$waiting/status" 2>/dev/null || true)
    [[ -n $caught ]] && (( 0x$caught & 1 )) && break
    sleep 0.1
  done
  kill -"$sig" "$waiting"
  stopped_at=$SECONDS
  wait "$waiting" && fail "a worker stopped by SIG$sig while connecting exited 0"
  (( SECONDS - stopped_at <= 5 )) || fail "a worker took $((SECONDS - stopped_at)) s to stop on SIG$sig while connecting"
  grep -q "stopped by a signal while reaching the coordinator" "$tmp/wait.err" ||
    fail "SIG$sig while connecting: $(cat "$tmp/wait.err")"
done
# Stopped while it waits on the data plane for its pipeline neighbour (stage 0 joined, then froze
# before connecting): it leaves within a fraction of a second, not when its 60 s window ends.
"$(dirname "$strata")/strata-coordinator" --secret-file "$tmp/secret" --listen 127.0.0.1:0 --control 127.0.0.1:0 \
  --replicas 1 --stages 2 --model synthetic:tiny 2>"$tmp/dp-coord.err" &
dp_coord=$!
dp_port=
for _ in $(seq 300); do
  dp_port=$(sed -n 's/.*(control port \([0-9]*\)).*/\1/p' "$tmp/dp-coord.err" 2>/dev/null || true)
  [[ -n $dp_port ]] && break
  sleep 0.1
done
"$worker" --coordinator "127.0.0.1:$dp_port" --secret-file "$tmp/secret" --name dp0 2>"$tmp/dp0.err" &
dp0=$!
for _ in $(seq 300); do grep -q "worker dp0 joined" "$tmp/dp-coord.err" && break; sleep 0.1; done
kill -STOP "$dp0"
"$worker" --coordinator "127.0.0.1:$dp_port" --secret-file "$tmp/secret" --name dp1 2>"$tmp/dp1.err" &
dp1=$!
for _ in $(seq 300); do grep -q "stage 1/2" "$tmp/dp1.err" && break; sleep 0.1; done
sleep 1   # in its accept by now
kill -TERM "$dp1"
stopped_at=$SECONDS
wait "$dp1" && fail "a worker stopped while waiting for its neighbour exited 0"
(( SECONDS - stopped_at <= 5 )) || fail "a worker took $((SECONDS - stopped_at)) s to stop while waiting on the data plane"
grep -q "stopped by a signal while waiting for stage 0" "$tmp/dp1.err" ||
  fail "SIGTERM while waiting on the data plane: $(cat "$tmp/dp1.err")"
kill -CONT "$dp0"; kill -TERM "$dp0" "$dp_coord" 2>/dev/null || true
wait "$dp0" "$dp_coord" 2>/dev/null || true
expect 2 "has 257 bytes; it must have 16 to 256" timeout 60 "$(dirname "$strata")/strata-coordinator" \
  --secret-file "$tmp/secret257" --listen 127.0.0.1:0 --control 127.0.0.1:0 --model synthetic:tiny
# An abbreviated --config (getopt takes --conf) was skipped: the server started on its defaults.
printf '{"listen": "127.0.0.1:0"}\n' >"$tmp/serve.json"
expect 2 "spell --config in full" timeout 60 "$strata" serve --conf "$tmp/serve.json" --model synthetic:tiny
expect 2 "unexpected argument 'extra'" "$worker" --coordinator 127.0.0.1:1 --secret-file "$tmp/secret" extra
expect 2 "^strata-worker: --coordinator and --secret-file are required" "$worker" --coordinator 127.0.0.1:1
expect 2 "^strata-worker: --nvme-kv-mib needs --nvme-dir" "$worker" --coordinator 127.0.0.1:1 \
  --secret-file "$tmp/secret" --nvme-kv-mib 8
head -c 5000 /dev/zero | tr '\0' s >"$tmp/secret5000"
expect 2 "secret5000: larger than 4096 bytes; a secret has at most 256 bytes" "$worker" --coordinator 127.0.0.1:1 \
  --secret-file "$tmp/secret5000"
for name in "" $'a\tb' "$(printf 'w%.0s' {1..129})"; do
  expect 2 "--name must be 1-128 bytes" "$worker" --coordinator 127.0.0.1:1 --secret-file "$tmp/secret" --name "$name"
done
if ! nvidia-smi -L >/dev/null 2>&1; then
  expect 1 "CUDA" "$worker" --coordinator 127.0.0.1:1 --secret-file "$tmp/secret" --device cuda:0
fi

# Served: the same tokens through two pipeline stages as from one local process.
"$strata" generate --model synthetic:tiny:seed=4 --prompt "served?" --max-tokens 12 >"$tmp/local.raw" 2>/dev/null ||
  fail "local generate on synthetic:tiny:seed=4 failed"
python3 -c 'import sys; sys.stdout.buffer.write(open(sys.argv[1], "rb").read().decode("utf-8", "replace").encode())' \
  "$tmp/local.raw" >"$tmp/local.txt"
# A prompt of 200 tokens (the synthetic tokenizer takes bytes): with 12 more, 4 blocks of 64 per
# layer, twice what the served device budget below holds for the whole batch. The served plan
# keeps no fp16 window (-r0), so that every full block is in a device slot or below it.
printf '# strata calibrate\n0-1:kivi2-r0\n2-3:kivi4-r0\n' >"$tmp/serve.plan"
long_prompt=$(printf 'streamed through the device layer by layer %.0s' 1 2 3 4 5 | head -c 200)
"$strata" generate --model synthetic:tiny:seed=4 --kv "$tmp/serve.plan" --prompt "$long_prompt" --max-tokens 12 \
  --no-echo >"$tmp/long.raw" \
  2>/dev/null || fail "local generate of the long prompt failed"
python3 -c 'import sys; sys.stdout.buffer.write(open(sys.argv[1], "rb").read().decode("utf-8", "replace").encode())' \
  "$tmp/long.raw" >"$tmp/long-local.txt"
# The same on one plan for every layer, which a request names (--kv-codecs below)
"$strata" generate --model synthetic:tiny:seed=4 --kv kivi4-r0 --prompt "$long_prompt" --max-tokens 12 \
  --no-echo >"$tmp/long4.raw" 2>/dev/null || fail "local generate of the long prompt on kivi4-r0 failed"
# (its text holds a U+0000, which the API's text chunks leave out: strata.proto's Chunk.text)
python3 -c 'import sys; sys.stdout.buffer.write(open(sys.argv[1], "rb").read().decode("utf-8", "replace")
                                                .replace("\0", "").encode())' "$tmp/long4.raw" >"$tmp/long4-local.txt"
cmp -s "$tmp/long4-local.txt" "$tmp/long-local.txt" && fail "kivi4-r0 and the plan file give the same text"
# Not quiet, and up to 240 s as tests/serve does: under the sanitizers beside other tests the start
# is slow, and if it never comes the log says how far it got.
# With KV tiers down to NVMe in a spill folder that does not exist yet: serve makes it (each worker
# its own folder inside) and removes it at exit. The KV plan comes from a file, as calibrate writes.
# The device budget (0.05 MiB: 2 blocks of every layer, 4 of one) is below the long prompt's KV,
# which then streams its layers through the device alone, as `strata generate` would. A request may
# name kivi4-r0 instead (its blocks are the size of the plan's largest: the capacity stays).
mkdir "$tmp/serve-tmp"   # its TMPDIR: where it keeps the cluster secret while it runs
TMPDIR="$tmp/serve-tmp" "$strata" serve --listen 127.0.0.1:0 --model synthetic:tiny:seed=4 --device-kv-mib 0.05 \
  --host-kv-mib 1 --nvme-kv-mib 8 --nvme-dir "$tmp/serve-spill" --kv "$tmp/serve.plan" --kv-codecs kivi4-r0 \
  --metrics 127.0.0.1:0 2>"$tmp/serve.log" &
server=$!
port=$(serve_port "$tmp/serve.log" "$server")
if [ -z "$port" ]; then
  fail "strata serve on synthetic:tiny did not become ready: $(tail -n 30 "$tmp/serve.log")"
else
  "$strata" generate --server "127.0.0.1:$port" --prompt "served?" --max-tokens 12 >"$tmp/served.txt" 2>"$tmp/err" ||
    fail "generate --server failed: $(tail -2 "$tmp/err")"
  cmp -s "$tmp/served.txt" "$tmp/local.txt" ||
    fail "served text differs from local: '$(head -c 120 "$tmp/served.txt")' vs '$(head -c 120 "$tmp/local.txt")'"
  grep -q "KV 0-1:kivi2-r0,2-3:kivi4-r0 (requests may name kivi4-r0)," "$tmp/serve.log" || fail "the plan file's plan is not served: $(grep KV "$tmp/serve.log")"
  grep -q "2 on the device, up to 4 for a sequence alone (streaming its layers)" "$tmp/serve.log" ||
    fail "unexpected KV capacity: $(grep 'KV blocks' "$tmp/serve.log")"
  # The long prompt and two short ones at once: the long one runs alone past the device budget
  # (the short ones wait for it or run before it), every text as from the local program.
  "$strata" generate --server "127.0.0.1:$port" --prompt "$long_prompt" --max-tokens 12 --no-echo \
    >"$tmp/long-served.txt" 2>"$tmp/long.err" &
  long_client=$!
  for i in 1 2; do
    "$strata" generate --server "127.0.0.1:$port" --prompt "served?" --max-tokens 12 >"$tmp/served-$i.txt" \
      2>"$tmp/err-$i" || fail "concurrent short request $i failed: $(tail -2 "$tmp/err-$i")"
    cmp -s "$tmp/served-$i.txt" "$tmp/local.txt" || fail "concurrent short request $i: '$(head -c 120 "$tmp/served-$i.txt")'"
  done
  wait "$long_client" || fail "the long prompt was not served: $(tail -2 "$tmp/long.err")"
  cmp -s "$tmp/long-served.txt" "$tmp/long-local.txt" ||
    fail "streamed text differs from local: '$(head -c 120 "$tmp/long-served.txt")' vs '$(head -c 120 "$tmp/long-local.txt")'"
  # On the request's own plan, streamed the same way
  "$strata" generate --server "127.0.0.1:$port" --prompt "$long_prompt" --max-tokens 12 --no-echo --kv kivi4-r0 \
    >"$tmp/long4-served.txt" 2>"$tmp/long4.err" || fail "the long prompt on kivi4-r0: $(tail -2 "$tmp/long4.err")"
  cmp -s "$tmp/long4-served.txt" "$tmp/long4-local.txt" ||
    fail "streamed on kivi4-r0: '$(head -c 120 "$tmp/long4-served.txt")' vs '$(head -c 120 "$tmp/long4-local.txt")'"
  # The workers report their tiers with their next step (here, the one freeing the sequences).
  mport=$(sed -n 's/.*ready: serving .* metrics port \([0-9]*\).*/\1/p' "$tmp/serve.log")
  python3 - "$mport" >"$tmp/metrics.txt" 2>&1 <<'PY' || fail "metrics after streaming: $(tail -3 "$tmp/metrics.txt")"
import sys, time, urllib.request
for _ in range(100):
    body = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=10).read().decode()
    value = {l.split()[0]: float(l.split()[1]) for l in body.splitlines() if l and not l.startswith("#")}
    spills, restores = value.get("strata_kv_spills_total", 0), value.get("strata_kv_restores_total", 0)
    if spills > 0 and restores > 0:
        break
    time.sleep(0.1)
# a decode step of the streamed sequence brings its blocks back up layer by layer
assert spills > 0 and restores > 0, f"no spills/restores while streaming: {spills} {restores}"
assert value.get("strata_kv_crc_failures_total", 0) == 0
print(f"spills {spills:.0f} restores {restores:.0f}")
PY
  [ -d "$tmp/serve-spill/local-0" ] && [ -d "$tmp/serve-spill/local-1" ] ||
    fail "no worker spill folders in $tmp/serve-spill: $(ls -la "$tmp/serve-spill" 2>&1)"
  # Whether a request is served within 60 s (a killed worker restarts and joins again).
  served_again() {
    for _ in $(seq 1 300); do
      "$strata" generate --server "127.0.0.1:$port" --prompt "served?" --max-tokens 2 >/dev/null 2>&1 && return 0
      sleep 0.2
    done
    return 1
  }
  # A worker killed and restarted finds its spill folder there; serve still removes it at exit.
  pkill -KILL -f -- "--nvme-dir $tmp/serve-spill/local-1" || fail "no worker local-1 to kill"
  served_again || fail "serve did not serve again after local-1 was killed: $(tail -n 5 "$tmp/serve.log")"
  # The spill folder removed while serving: a worker killed then comes back (serve makes the
  # folder again) instead of failing for ever.
  rm -rf "$tmp/serve-spill"
  pkill -KILL -f -- "--nvme-dir $tmp/serve-spill/local-0" || fail "no worker local-0 to kill"
  served_again || fail "serve did not serve again after its spill folder was removed: $(tail -n 5 "$tmp/serve.log")"
  [ -d "$tmp/serve-spill/local-0" ] || fail "the restarted worker has no spill folder: $(tail -n 5 "$tmp/serve.log")"
  # Its cluster secret removed too (a cleanup of TMPDIR): serve writes it again for the restart.
  rm -rf "${tmp:?}/serve-tmp/"*
  pkill -KILL -f -- "--nvme-dir $tmp/serve-spill/local-1" || fail "no worker local-1 to kill"
  served_again || fail "serve did not serve again after its cluster secret was removed: $(tail -n 5 "$tmp/serve.log")"
  grep -q "cluster secret .* was removed; written again" "$tmp/serve.log" || fail "no word of the secret written again"
fi
# A hangup (the terminal it ran in closed) drains and cleans up as SIGTERM does (serve_e2e
# checks SIGTERM and SIGINT): no cluster secret left behind.
kill -HUP "$server" 2>/dev/null
wait "$server" || fail "strata serve exited $? after SIGHUP: $(tail -3 "$tmp/serve.log")"
grep -q "hangup: draining" "$tmp/serve.log" || fail "no drain on SIGHUP: $(tail -3 "$tmp/serve.log")"
[ -z "$(ls -A "$tmp/serve-tmp")" ] || fail "serve left files in its TMPDIR: $(ls -laR "$tmp/serve-tmp")"
# Started ignoring SIGHUP (nohup), serve keeps ignoring it, as do its workers; SIGTERM drains.
(trap '' HUP; exec "$strata" serve --listen 127.0.0.1:0 --model synthetic:tiny:seed=4 2>"$tmp/nohup.log") &
server=$!
port=$(serve_port "$tmp/nohup.log" "$server")
[ -n "$port" ] || fail "strata serve under nohup did not become ready: $(tail -n 5 "$tmp/nohup.log")"
kill -HUP "$server"
pkill -HUP -P "$server" -f -- "--name local-0" || fail "no worker local-0 under the nohup serve"
sleep 1
"$strata" generate --server "127.0.0.1:$port" --prompt "still there?" --max-tokens 2 >/dev/null 2>"$tmp/err" ||
  fail "serve started ignoring SIGHUP stopped serving after one: $(tail -n 3 "$tmp/nohup.log")"
kill -TERM "$server"
wait "$server" || fail "strata serve exited $? after SIGTERM: $(tail -3 "$tmp/nohup.log")"
grep -q "hangup\|exited (" "$tmp/nohup.log" && fail "a hangup reached serve or its worker: $(tail -n 5 "$tmp/nohup.log")"
# (under the sanitizers a worker's report would only be in the log: its restart hides it otherwise)
grep -q "Sanitizer\|runtime error" "$tmp/serve.log" && fail "sanitizer report in the serve log: $(grep -m3 "Sanitizer\|runtime error" "$tmp/serve.log")"
[ ! -e "$tmp/serve-spill" ] || fail "serve left its spill folder: $(ls -laR "$tmp/serve-spill" 2>&1 | head)"
serve_bad "--nvme-dir $tmp/none/spill: cannot create it" --host-kv-mib 1 --nvme-kv-mib 8 --nvme-dir "$tmp/none/spill"

# As from a terminal: serve leads its own session and group, with SIGINT and SIGHUP at their
# defaults, and started with SIGCHLD ignored (which would hide every worker's exit from it). Its
# control server listens on another loopback address than 127.0.0.1, which the workers dial.
python3 -c 'import os, signal, sys
os.setsid()
for s in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
    signal.signal(s, signal.SIG_DFL)
signal.signal(signal.SIGCHLD, signal.SIG_IGN)
os.execv(sys.argv[1], sys.argv[1:])' "$strata" serve --listen 127.0.0.1:0 --control 127.0.0.2:0 \
  --model synthetic:tiny:seed=4 --drain-seconds 240 2>"$tmp/tty.log" &   # (a slow sanitizer build drains long)
server=$!
port=$(serve_port "$tmp/tty.log" "$server")
if [ -z "$port" ]; then
  fail "strata serve with --control 127.0.0.2:0 did not become ready: $(tail -n 5 "$tmp/tty.log")"
else
  # A worker that exits is restarted although serve was started ignoring SIGCHLD.
  pkill -KILL -P "$server" -f -- "--name local-0" || fail "no worker local-0 to kill"
  for _ in $(seq 1 300); do
    "$strata" generate --server "127.0.0.1:$port" --prompt "served?" --max-tokens 2 >/dev/null 2>&1 && break
    sleep 0.2
  done
  grep -q "worker local-0 exited (signal 9); restarting" "$tmp/tty.log" ||
    fail "serve started ignoring SIGCHLD did not see its worker exit: $(tail -n 5 "$tmp/tty.log")"
  # Ctrl-C: SIGINT to the terminal's foreground group, serve's. The workers lead their own
  # groups, so serve alone gets it and drains: the running request completes.
  "$strata" generate --server "127.0.0.1:$port" --prompt "drained?" --max-tokens 1000 --ignore-eos --no-echo \
    >"$tmp/drained.txt" 2>"$tmp/drained.err" &
  client=$!
  for _ in $(seq 1 300); do [ -s "$tmp/drained.txt" ] && break; sleep 0.05; done
  kill -INT -- "-$server"
  wait "$client" || fail "a request running at Ctrl-C failed: $(tail -2 "$tmp/drained.err"; tail -n 5 "$tmp/tty.log")"
  wait "$server" || fail "strata serve exited $? after Ctrl-C: $(tail -3 "$tmp/tty.log")"
  grep -q "interrupted: draining" "$tmp/tty.log" || fail "no drain on Ctrl-C: $(tail -3 "$tmp/tty.log")"
  grep -q "stopped by a signal" "$tmp/tty.log" && fail "Ctrl-C reached the workers: $(tail -n 5 "$tmp/tty.log")"
fi
kill -KILL "$server" 2>/dev/null

# serve SIGKILLed before its workers joined: they end with it (not after their 30 s connect
# timeout, or their 60 s wait for a pipeline neighbour).
mkdir "$tmp/killed-tmp"   # where the SIGKILLed serve leaves its cluster secret
TMPDIR="$tmp/killed-tmp" "$strata" serve --listen 127.0.0.1:0 --model synthetic:tiny:seed=4 -q 2>"$tmp/killed.log" &
server=$!
for _ in $(seq 1 200); do [ "$(pgrep -c -P "$server")" -ge 2 ] && break; sleep 0.01; done
orphans=$(pgrep -P "$server" | tr '\n' ' ')
[ -n "$orphans" ] || fail "serve started no worker: $(tail -n 3 "$tmp/killed.log")"
kill -KILL "$server"
wait "$server" 2>/dev/null
# still_running PID...: those of PID still running after up to 5 s (an exited worker may stay a
# zombie a moment: init reaps it).
still_running() {
  local left p
  for _ in $(seq 1 50); do
    left=$(for p in "$@"; do ps -o stat= -p "$p" 2>/dev/null | grep -qv Z && echo "$p"; done | tr '\n' ' ')
    [ -z "$left" ] && break
    sleep 0.1
  done
  echo "$left"
}
# shellcheck disable=SC2086 # one word per pid
left=$(still_running $orphans)
[ -z "$left" ] || { fail "workers $left outlived a SIGKILLed serve by 5 s"; kill -KILL $left 2>/dev/null; }

# The same through a --worker-bin wrapper that runs the worker as its child (no exec): serve is
# then the worker's grandparent, which no death signal covers; the worker watches it by pidfd.
# The wrapper points the worker at a closed port, so that it is still trying to join (30 s)
# whenever serve is killed.
printf '#!/bin/sh\n%s/strata-worker "$@" --coordinator 127.0.0.1:1\n' "$(dirname "$strata")" >"$tmp/wrapper.sh"
chmod +x "$tmp/wrapper.sh"
TMPDIR="$tmp/killed-tmp" "$strata" serve --listen 127.0.0.1:0 --model synthetic:tiny:seed=4 -q \
  --worker-bin "$tmp/wrapper.sh" 2>"$tmp/killed-wrapped.log" &
server=$!
wrapped=""
for _ in $(seq 1 300); do
  wrapped=$(for w in $(pgrep -P "$server"); do pgrep -P "$w"; done | tr '\n' ' ')
  [ "$(wc -w <<<"$wrapped")" -ge 2 ] && break
  sleep 0.01
done
[ -n "$wrapped" ] || fail "serve started no wrapped worker: $(tail -n 3 "$tmp/killed-wrapped.log")"
sleep 0.5   # past the worker's start, where it sets up its watch
kill -KILL "$server"
wait "$server" 2>/dev/null
# shellcheck disable=SC2086 # one word per pid
left=$(still_running $wrapped)
[ -z "$left" ] || { fail "wrapped workers $left outlived a SIGKILLed serve by 5 s"; kill -KILL $left 2>/dev/null; }
grep -q "cannot watch" "$tmp/killed-wrapped.log" && fail "a wrapped worker could not watch serve: $(cat "$tmp/killed-wrapped.log")"

# Giving up on workers that never join (a --worker-bin wrapper whose child sleeps): each worker's
# process group gets SIGTERM 2 s into the stop, the wrapper's child included, not a SIGKILL of the
# wrapper alone after 10 s (which left the child running). A child that ignores SIGTERM and
# outlives its wrapper is SIGKILLed with the rest of the group once the wrapper has exited.
printf '#!/bin/sh\n(trap "" TERM; exec sleep 1001.%s) &\nsleep 1000.%s\n' "$$" "$$" >"$tmp/sleeper.sh"
chmod +x "$tmp/sleeper.sh"   # (command lines to find them by)
SECONDS=0
expect 1 "only 0 of 2 workers ready after 2 s; giving up" env TMPDIR="$tmp/killed-tmp" "$strata" serve \
  --listen 127.0.0.1:0 --model synthetic:tiny:seed=4 --worker-bin "$tmp/sleeper.sh" --ready-timeout 2
(( SECONDS <= 8 )) || fail "serve took $SECONDS s to stop workers that never joined"
sleep 0.5
pgrep -f "^sleep 1000\.$$\$" >/dev/null && { fail "a worker wrapper's child outlived serve"; pkill -f "^sleep 1000\.$$\$"; }
pgrep -f "^sleep 1001\.$$\$" >/dev/null &&
  { fail "a wrapper's child ignoring SIGTERM outlived serve"; pkill -KILL -f "^sleep 1001\.$$\$"; }

# With `stty tostop` on serve's terminal, the workers (background groups there) still write to
# it and join: SIGTTOU stopped each at its first line, and serve gave up on them.
python3 - "$strata" >"$tmp/tostop.log" 2>&1 <<'PY' || fail "serve under a tostop terminal: $(tail -n 5 "$tmp/tostop.log")"
import os, pty, select, signal, sys, termios, time
pid, fd = pty.fork()
if pid == 0:   # a session of its own, the pty its controlling terminal, in the foreground
    attrs = termios.tcgetattr(0)
    attrs[3] |= termios.TOSTOP
    termios.tcsetattr(0, termios.TCSANOW, attrs)
    os.execv(sys.argv[1], [sys.argv[1], "serve", "--listen", "127.0.0.1:0", "--model", "synthetic:tiny:seed=4",
                           "--ready-timeout", "60"])
out, deadline = b"", time.monotonic() + 90
while b"ready: serving" not in out and time.monotonic() < deadline:
    if select.select([fd], [], [], 1)[0]:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
os.kill(pid, signal.SIGTERM)
while True:   # let it drain and stop, reading what it writes meanwhile
    try:
        if not os.read(fd, 65536):
            break
    except OSError:
        break
os.waitpid(pid, 0)
sys.stdout.write(out.decode(errors="replace"))
sys.exit(0 if b"ready: serving" in out and b"asked 127.0.0.1" in out else 1)
PY

[ "$failures" -eq 0 ] || { echo "test_synthetic: $failures failure(s)" >&2; exit 1; }
echo "test_synthetic: ok"
