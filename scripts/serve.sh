#!/usr/bin/env bash
# The main job on a machine without a GPU: set up (Debian packages, the default model, the
# build), then serve the gRPC API with `strata serve` (a coordinator and two CPU worker
# processes: one replica whose 30 layers are split into 2 pipeline stages) and send it requests
# with `strata generate --server`, then stop the server with SIGTERM (it drains first).
# With arguments, they go to `strata serve`, which then runs in the foreground until Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh build
if [ $# -gt 0 ]; then
  exec build/strata serve "$@"
fi

addr=127.0.0.1:50051
log=$(mktemp)
build/strata serve --listen "$addr" --metrics 127.0.0.1:9400 2>"$log" &
server=$!
trap 'kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; rm -f "$log"' EXIT
echo "== strata serve --listen $addr --metrics 127.0.0.1:9400 (pid $server): waiting for its workers =="
for _ in $(seq 600); do
  if grep -q "ready: serving" "$log"; then break; fi
  if ! kill -0 "$server" 2>/dev/null; then cat "$log" >&2; echo "strata serve exited" >&2; exit 1; fi
  sleep 0.5
done
cat "$log"
grep -q "ready: serving" "$log" || { echo "strata serve did not become ready" >&2; exit 1; }

echo
echo "== strata generate --server $addr --prompt 'The capital of France is' --max-tokens 32 --stats =="
build/strata generate --server "$addr" --prompt "The capital of France is" --max-tokens 32 --stats
context="The Industrial Revolution began in Great Britain in the late eighteenth century and spread \
to continental Europe and North America during the following decades. It replaced hand production \
with machines, introduced new chemical manufacturing and iron production processes, and made steam \
power and water power far more widely used."
echo
echo "== four questions at once (continuous batching: they share the workers' steps) =="
# The server applies no chat template: a client sends the model's own format (ChatML for
# SmolLM2-Instruct), control tokens included, as `strata generate --chat` would build it.
# (printf -v: a command substitution would drop the final newline the template needs)
chat() { printf -v prompt '<|im_start|>user\n%s<|im_end|>\n<|im_start|>assistant\n' "$1"; }
questions=("In which country did the Industrial Revolution begin?" "What did it replace?"
           "Which kinds of power did it make more widely used?" "To which continents did it spread?")
pids=()
for i in "${!questions[@]}"; do
  chat "$context ${questions[$i]}"
  build/strata generate --server "$addr" --prompt "$prompt" --max-tokens 40 \
    --stop $'\n' --no-echo > "$log.$i" &
  pids+=($!)
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
for i in "${!questions[@]}"; do echo "Q: ${questions[$i]}"; echo "A: $(cat "$log.$i")"; rm -f "$log.$i"; done
[ "$status" -eq 0 ] || { echo "a request failed" >&2; exit 1; }
echo
echo "== metrics (curl http://127.0.0.1:9400/metrics | grep strata_) =="
if command -v curl >/dev/null; then
  curl -s http://127.0.0.1:9400/metrics | grep -E '^strata_(requests_total|tokens_generated_total|kv_blocks|workers_ready)' || true
fi
echo
echo "== stopping the server (SIGTERM: drains, then stops the workers) =="
kill -TERM "$server"
wait "$server" || true
trap 'rm -f "$log"' EXIT
tail -n 3 "$log"
