#!/usr/bin/env bash
# The main job on a machine without a GPU: set up, build, and generate text with the default
# model through a 4-bit KIVI-compressed KV cache. Extra arguments go to `strata generate`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh build
if [ $# -eq 0 ]; then
  set -- --prompt "The capital of France is" --max-tokens 32 --kv kivi4 --stats
fi
exec build/strata generate "$@"
