#!/usr/bin/env bash
# Builds the GPU test and benchmark programs here (where the build dependencies are) and packs
# them with the shared libraries the GPU machine lacks into build-gpu-bundle/, for a lent GPU
# machine that has the CUDA driver and toolkit but none of the Debian packages (cmocka,
# OpenBLAS). Run them there with scripts/gpu-run.sh. See docs/gpu.md.
#   scripts/gpu-bundle.sh            # build-gpu/ (RelWithDebInfo, sm_90) -> build-gpu-bundle/
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh >/dev/null
programs=(tests/cuda/test_cuda_plan tests/cuda/test_cuda_ops tests/cuda/test_cuda_attention
          tests/cuda/test_cuda_encode tests/cuda/test_cuda_sample tests/cuda/test_cuda_model tests/cuda/test_cuda_weights
          tests/cuda/test_cuda_uploads
          tests/test_transport tests/test_stage bench/strata-bench-attention bench/strata-bench-decode-gpu
          strata strata-worker)
# RelWithDebInfo, as CI builds (-O2; the binaries are stripped below): a Release build's -O3 warns
# where CI's does not (-Werror), and a bundle that does not build costs a GPU session.
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSTRATA_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 >/dev/null
targets=()
for p in "${programs[@]}"; do targets+=(--target "$(basename "$p")"); done
cmake --build build-gpu -j"$(nproc)" "${targets[@]}"

out=build-gpu-bundle
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
for p in "${programs[@]}"; do
  cp "build-gpu/$p" "$out/bin/"
  strip --strip-unneeded "$out/bin/$(basename "$p")"
done
# Every library the programs load except the C/C++ runtime, the CUDA driver, cuBLAS (600 MiB) and
# NCCL (210 MiB), which the GPU machine has (its CUDA toolkit is the same 13.0; NCCL comes with
# PyTorch's wheels) in versions at least as new.
for p in "$out"/bin/*; do
  ldd "$p" | awk '/=> \// { print $1, $3 }'
done | sort -u | while read -r name path; do
  case "$name" in
    libc.so.*|libm.so.*|libdl.so.*|libpthread.so.*|librt.so.*|libstdc++.so.*|libgcc_s.so.*|libcuda.so.*) ;;
    libcublas.so.*|libcublasLt.so.*|libnccl.so.*) ;;
    *) cp -L "$path" "$out/lib/$name" ;;
  esac
done
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
git diff --quiet HEAD 2>/dev/null || commit="$commit+uncommitted changes"
echo "$commit" > "$out/COMMIT"
# Packed (OpenBLAS alone is 36 MiB unpacked): scripts/gpu-run.sh unpacks it on the GPU machine.
# xz with a dictionary larger than one program: every test program links the same kernels (about
# 8 MiB of device code each), which gzip's 32 KiB window compresses once per program and xz once.
tar cf - -C "$out" bin lib COMMIT | xz -9 -T0 > "$out/bundle.txz"
rm -rf "$out/bin" "$out/lib"
size=$(du -sm "$out" | cut -f1)
echo "gpu bundle: $out ($size MiB; the device tool carries at most 64 MiB in all)"
[ "$size" -lt 60 ] || { echo "gpu-bundle: $out is too large to carry" >&2; exit 1; }
[ "$size" -le 19 ] ||
  echo "gpu-bundle: warning: $size MiB leaves no room for the model's first 40 MiB part and the tree in the same" \
    "call: give scripts/gpu-model-parts.sh a smaller part size (docs/gpu.md)" >&2
tar tJvf "$out/bundle.txz"
