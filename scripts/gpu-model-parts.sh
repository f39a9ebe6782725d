#!/usr/bin/env bash
# Splits the default model (94 MiB) into parts that fit beside the bundle in the lent GPU
# machine's calls, which carry at most 64 MiB each: build-gpu-model/part.NN and SHA256. Carry
# them over consecutive calls (the machine keeps what earlier calls carried while it stays warm);
# scripts/gpu-run.sh joins them when every part is there and runs the real-model tests on it.
# docs/gpu.md says which part goes with which call.
#   scripts/gpu-model-parts.sh [PART_MIB]     # default 40: two calls beside a bundle of up to 19 MiB
set -euo pipefail
cd "$(dirname "$0")/.."
part_mib=${1:-40}
case "$part_mib" in ''|*[!0-9]*) echo "gpu-model-parts: PART_MIB must be a whole number of MiB" >&2; exit 2 ;; esac
scripts/setup.sh >/dev/null
model=$(ls models/*.gguf | head -1)
out=build-gpu-model
rm -rf "$out"
mkdir -p "$out"
split -b "${part_mib}M" -d -a 2 "$model" "$out/part."
sha256sum "$model" | cut -d' ' -f1 > "$out/SHA256"
basename "$model" > "$out/NAME"
ls -l "$out"
# Call 1 carries the bundle, the first part and the working tree (about 5 MiB).
if [ -f build-gpu-bundle/bundle.txz ]; then
  bundle_mib=$(( ($(stat -c %s build-gpu-bundle/bundle.txz) + 1048575) / 1048576 ))
  if [ $(( bundle_mib + part_mib + 5 )) -gt 64 ]; then
    echo "gpu-model-parts: warning: a ${bundle_mib} MiB bundle, a ${part_mib} MiB part and the tree exceed one call's" \
      "64 MiB: pass a smaller PART_MIB" >&2
  fi
fi
