#!/usr/bin/env bash
# Every test: set up, build (CUDA sources compiled when nvcc is present), run the suite, then
# build again with AddressSanitizer + UndefinedBehaviorSanitizer and run the suite there too.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
jobs=$(nproc)
# ctest already runs one test per core; OpenBLAS threads on top of that only yield to each other
# (15-20 % of the fake-device tests' time on a 2-core runner).
export OPENBLAS_NUM_THREADS=1

echo "== build (RelWithDebInfo) =="
scripts/build.sh build
echo "== tests =="
ctest --test-dir build --output-on-failure -j"$jobs"

echo "== build (ASan + UBSan) =="
scripts/build.sh build-asan -DSTRATA_SANITIZE=ON -DSTRATA_CUDA=OFF
echo "== tests under ASan + UBSan =="
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan --output-on-failure -j"$jobs"
