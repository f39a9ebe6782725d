#!/usr/bin/env bash
# The main job on a machine without a GPU: set up, build, and generate text with the default
# model through compressed KV caches. With no arguments it runs two demos: a short prompt through
# a 4-bit KIVI cache, then a question after a long paragraph through a 2-bit KIVI cache with a
# 32-token fp16 window, so that most of the context sits in compressed blocks (see the stats).
# With arguments, they go to `strata generate` instead.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh build
if [ $# -gt 0 ]; then
  exec build/strata generate "$@"
fi
echo "== strata generate --prompt 'The capital of France is' --kv kivi4 --stats =="
build/strata generate --prompt "The capital of France is" --max-tokens 32 --kv kivi4 --stats
context="The Industrial Revolution began in Great Britain in the late eighteenth century and spread \
to continental Europe and North America during the following decades. It replaced hand production \
with machines, introduced new chemical manufacturing and iron production processes, and made steam \
power and water power far more widely used. Textiles were the dominant industry in terms of \
employment, the value of output and the capital invested. Many of the technological and \
architectural innovations were of British origin, and by the middle of the eighteenth century \
Britain was the world's leading commercial nation."
echo
echo "== a question after a paragraph: --kv kivi2 --kv-residual 32 --stats =="
build/strata generate --prompt "$context Question: in which country did the Industrial Revolution begin? Answer:" \
  --max-tokens 24 --kv kivi2 --kv-residual 32 --stop $'\n' --no-echo --stats
