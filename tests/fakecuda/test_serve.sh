#!/usr/bin/env bash
# `strata serve` with its workers computing on the fake GPU (tests/fakecuda/README.md): two
# replicas of two GPU stages each. Greedy output equals single-process `strata generate` on the
# CPU, also for a request naming one of --kv-codecs; `strata drain` moves a running request
# between GPU workers (its blocks travel as the sequence image) and the request finishes with the
# tokens it gives unmoved; a request whose workers are killed goes on with the tokens it gives
# uninterrupted (recovery).
# usage: test_serve.sh STRATA STRATA_WORKER_FAKECUDA
set -euo pipefail
strata=$1
fakeworker=$2
tmp=$(mktemp -d)
pid=
cleanup() {
  if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; [ -f "$tmp/serve.log" ] && tail -30 "$tmp/serve.log" >&2; exit 1; }

wait_ready() {
  port=
  for _ in $(seq 1200); do
    # The log may not exist yet: the server's shell opens it after this script moves on.
    port=$(sed -n 's/.*ready: serving .* on port \([0-9]*\).*/\1/p' "$tmp/serve.log" 2>/dev/null | head -1 || true)
    [ -n "$port" ] && break
    kill -0 "$pid" 2>/dev/null || fail "strata serve exited before it was ready"
    sleep 0.2
  done
  [ -n "$port" ] || fail "strata serve was not ready within 240 s"
  addr=127.0.0.1:$port
}

printf '#!/bin/sh\nexec "%s" --device cuda:0 "$@"\n' "$fakeworker" >"$tmp/worker"
chmod +x "$tmp/worker"
"$strata" serve --listen 127.0.0.1:0 --replicas 2 --stages 2 --ctx 512 --kv-codecs fp16 --worker-bin "$tmp/worker" \
  --max-recoveries 2 >"$tmp/serve.log" 2>&1 &
pid=$!
wait_ready
[ "$(grep -c "of .* on cuda:0" "$tmp/serve.log")" = 4 ] || fail "the four workers did not say they compute on cuda:0"

# Greedy: served by the GPU stages = generated alone on the CPU.
p="The capital of France is"
want=$("$strata" generate -p "$p" -n 12 --ignore-eos --no-echo -q)
got=$("$strata" generate --server "$addr" -p "$p" -n 12 --ignore-eos --no-echo -q) || fail "served generate"
[ "$got" = "$want" ] || fail "served '$got', CPU '$want'"
# A request on its own KV plan (one of --kv-codecs) and one on the server's, at once: each equals
# generate on the CPU with that codec. The prompt (~250 tokens) is one whose greedy text differs
# between the two codecs, so that a request run on the wrong plan shows. (Sequences of two plans
# in the same steps of a GPU stage: test_stage_fake and test_cuda_model_fake.)
paper=$(dirname "$0")/../../../shared/papers/kivi.txt
[ -f "$paper" ] || fail "$paper missing (../shared must sit beside the repository)"
head -c 1100 "$paper" >"$tmp/long.txt"
want16=$("$strata" generate -p - -n 24 --ignore-eos --no-echo -q --kv fp16 <"$tmp/long.txt")
want4=$("$strata" generate -p - -n 24 --ignore-eos --no-echo -q <"$tmp/long.txt")
[ "$want16" != "$want4" ] || fail "fp16 and kivi4 give the same text on the long prompt: it tells no plan apart"
"$strata" generate --server "$addr" -p - -n 24 --ignore-eos --no-echo -q --kv fp16 <"$tmp/long.txt" >"$tmp/g16" \
  2>"$tmp/g16.err" &
g16=$!
got4=$("$strata" generate --server "$addr" -p - -n 24 --ignore-eos --no-echo -q <"$tmp/long.txt") || fail "served kivi4"
wait "$g16" || fail "a request on fp16: $(cat "$tmp/g16.err")"
[ "$(cat "$tmp/g16")" = "$want16" ] || fail "served on fp16 '$(cat "$tmp/g16")', CPU '$want16'"
[ "$got4" = "$want4" ] || fail "served on kivi4 beside it '$got4', CPU '$want4'"

# Unmoved references, then the same two requests (one per replica) with a drain in the middle
# (long enough that the drain, a new process, arrives before they end even on a loaded machine).
ref1=$("$strata" generate --server "$addr" -p "Once upon a time" -n 160 --ignore-eos --no-echo -q)
ref2=$("$strata" generate --server "$addr" -p "The weather today" -n 160 --ignore-eos --no-echo -q)
"$strata" generate --server "$addr" -p "Once upon a time" -n 160 --ignore-eos --no-echo -q >"$tmp/a" 2>"$tmp/a.err" &
ga=$!
"$strata" generate --server "$addr" -p "The weather today" -n 160 --ignore-eos --no-echo -q >"$tmp/b" 2>"$tmp/b.err" &
gb=$!
for _ in $(seq 600); do   # both running: each has streamed its first text
  [ -s "$tmp/a" ] && [ -s "$tmp/b" ] && break
  sleep 0.1
done
"$strata" drain --server "$addr" local-0 --timeout 300 >"$tmp/drain" 2>&1 || fail "drain: $(cat "$tmp/drain")"
wait "$ga" || fail "request a: $(cat "$tmp/a.err")"
wait "$gb" || fail "request b: $(cat "$tmp/b.err")"
grep -q "1 moved, 0 failed" "$tmp/drain" || fail "drain said: $(cat "$tmp/drain")"
grep -q "moved from replica" "$tmp/serve.log" || fail "the coordinator logged no migration"
[ "$(cat "$tmp/a")" = "$ref1" ] || fail "request a after the drain: '$(cat "$tmp/a")' != '$ref1'"
[ "$(cat "$tmp/b")" = "$ref2" ] || fail "request b after the drain: '$(cat "$tmp/b")' != '$ref2'"

# Recovery on GPU stages: the last stage of both replicas is killed while a request streams (one
# after the other: it may go on on the second before that one is lost too, hence
# --max-recoveries 2 above); with no replica serving, the request waits for serve to restart the
# workers, goes on on a rebuilt replica from its prompt and streamed tokens (their KV recomputed
# by the GPU prefill), and gives the greedy tokens of an uninterrupted run. Greedy, not sampled:
# the GPU stage's fp16 rounding makes the recomputed KV differ enough that a sampled stream
# (temperature 0.8) went its own way after ~30 tokens here; its draws do continue where they
# were (the stage takes them from the same host sampler as the CPU stage, skip included).
for _ in $(seq 1200); do   # the drained replica serves again
  [ "$(grep -c "replica [0-9]* is serving" "$tmp/serve.log")" -ge 3 ] && break
  sleep 0.2
done
greedy=(-p "Once upon a time" -n 160 --ignore-eos --no-echo -q --kv fp16)
ref3=$("$strata" generate --server "$addr" "${greedy[@]}") || fail "reference"
"$strata" generate --server "$addr" "${greedy[@]}" >"$tmp/c" 2>"$tmp/c.err" &
gc=$!
for _ in $(seq 600); do
  [ -s "$tmp/c" ] && break
  sleep 0.05
done
for r in 0 1; do
  name=$(sed -n "s/.*worker \([^ ]*\) joined as replica $r stage 1 .*/\1/p" "$tmp/serve.log" | tail -1)
  # This server's worker only (-P): serve_e2e's workers, which ctest may run beside this test,
  # carry the same names (a kill by name alone once took one of theirs down).
  victim=$(pgrep -P "$pid" -f -- "--name $name( |\$)") || fail "no worker process named '$name'"
  kill -KILL $victim
done
wait "$gc" || fail "the request whose workers were killed: $(cat "$tmp/c.err")"
[ "$(cat "$tmp/c")" = "$ref3" ] || fail "after the recovery: '$(cat "$tmp/c")' != uninterrupted '$ref3'"
grep -q "it goes on from its" "$tmp/serve.log" || fail "the coordinator logged no recovery"
kill -TERM "$pid"
wait "$pid" || fail "strata serve did not stop cleanly"
pid=

# Prefix caching on GPU stages: a finished request's first blocks are parked as a tail-less
# sequence image (exported from the device pool), and a request starting with the same tokens
# imports it into the device pool and prefills only the rest. fp16, so the output must equal the
# CPU's token for token; a second turn (the first answer and a question appended) reuses the
# first turn's parked prompt and answer.
"$strata" serve --listen 127.0.0.1:0 --stages 2 --ctx 512 --kv fp16 --prefix-cache-mib 8 --worker-bin "$tmp/worker" \
  >"$tmp/serve.log" 2>&1 &
pid=$!
wait_ready
"$strata" generate --server "$addr" -p - -n 24 --ignore-eos --no-echo -q <"$tmp/long.txt" >/dev/null || fail "first turn"
for turn in 1 2; do
  got=$("$strata" generate --server "$addr" -p - -n 24 --ignore-eos --no-echo -q --stats <"$tmp/long.txt" \
    2>"$tmp/p.err") || fail "prefix turn $turn: $(cat "$tmp/p.err")"
  [ "$got" = "$want16" ] || fail "from the prefix cache (turn $turn) '$got', CPU '$want16'"
  grep -q "(192 from the prefix cache)" "$tmp/p.err" || fail "turn $turn did not copy 192 tokens: $(cat "$tmp/p.err")"
done
{ cat "$tmp/long.txt"; printf '%s\nQ: what is this about? A:' "$want16"; } >"$tmp/turn2.txt"
want2=$("$strata" generate -p - -n 16 --ignore-eos --no-echo -q --kv fp16 <"$tmp/turn2.txt")
got2=$("$strata" generate --server "$addr" -p - -n 16 --ignore-eos --no-echo -q --stats <"$tmp/turn2.txt" \
  2>"$tmp/p.err") || fail "second turn: $(cat "$tmp/p.err")"
[ "$got2" = "$want2" ] || fail "second turn from the prefix cache '$got2', CPU '$want2'"
grep -q "(256 from the prefix cache)" "$tmp/p.err" || fail "the second turn did not reuse the first answer: $(cat "$tmp/p.err")"
echo "serve_fakecuda: ok ($(tail -1 "$tmp/drain"); prefix cache on GPU stages)"
kill -TERM "$pid"
wait "$pid" || fail "strata serve did not stop cleanly"
pid=
# (under the sanitizers a worker's report would only be in the log: its restart hides it otherwise)
! grep -q "Sanitizer\|runtime error" "$tmp/serve.log" || fail "sanitizer report in the serve log"
