#!/usr/bin/env bash
# On a GPU machine, with build-gpu-bundle/ from scripts/gpu-bundle.sh beside it: the GPU tests
# (GPU against the CPU reference), the same under compute-sanitizer, then the attention benchmark.
# Logs and the benchmark's CSV go to $OUT (or ./gpu-out). Arguments after -- go to the benchmark.
#   scripts/gpu-run.sh [--no-sanitizer] [--no-bench] [-- BENCH ARGS]
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
sanitize=1 bench=1
while [ $# -gt 0 ]; do
  case "$1" in
    --no-sanitizer) sanitize=0 ;;
    --no-bench) bench=0 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,6p' "$0"; exit 0 ;;
    *) echo "gpu-run: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
bundle=build-gpu-bundle
[ -d "$bundle/bin" ] || { echo "gpu-run: $bundle/ missing: run scripts/gpu-bundle.sh first" >&2; exit 2; }
out=${OUT:-gpu-out}
mkdir -p "$out"
# cuBLAS is not carried (600 MiB): the machine's CUDA toolkit, or the pip wheel PyTorch uses.
cublas_dirs=
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && cublas_dirs+="$d:"
done
cublas_dirs+=$(python3 -c 'import nvidia.cublas, os; print(os.path.join(list(nvidia.cublas.__path__)[0], "lib"))' 2>/dev/null || true)
export LD_LIBRARY_PATH="$PWD/$bundle/lib:${cublas_dirs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="$PATH:/usr/local/cuda/bin"   # compute-sanitizer lives with the toolkit
echo "bundle built from commit $(cat "$bundle/COMMIT")" | tee "$out/summary.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | tee -a "$out/summary.txt"
status=0
# test_cuda_model compares with the CPU on synthetic models, and on the real one when STRATA_MODEL
# names it (the model file does not fit one device call's 64 MiB: docs/gpu.md).
for t in test_cuda_plan test_cuda_ops test_cuda_attention test_cuda_encode test_cuda_model; do
  "$bundle/bin/$t" > "$out/$t.log" 2>&1
  rc=$?
  echo "$t: exit $rc" | tee -a "$out/summary.txt"
  [ $rc -eq 0 ] || { status=1; tail -n 30 "$out/$t.log"; }
done
if [ $sanitize = 1 ]; then
  if command -v compute-sanitizer >/dev/null; then
    for t in test_cuda_ops test_cuda_attention test_cuda_encode; do
      for tool in memcheck racecheck; do
        compute-sanitizer --tool "$tool" --error-exitcode 99 "$bundle/bin/$t" > "$out/$t.$tool.log" 2>&1
        rc=$?
        echo "$t under compute-sanitizer $tool: exit $rc" | tee -a "$out/summary.txt"
        [ $rc -eq 0 ] || { status=1; tail -n 30 "$out/$t.$tool.log"; }
      done
    done
  else
    echo "compute-sanitizer not found: sanitizer runs skipped" | tee -a "$out/summary.txt"
  fi
fi
if [ $bench = 1 ]; then
  "$bundle/bin/strata-bench-attention" --csv "$out/attention.csv" "$@" 2>&1 | tee "$out/attention.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
cat "$out/summary.txt"
exit $status
