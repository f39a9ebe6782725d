#!/usr/bin/env bash
# On a GPU machine, with build-gpu-bundle/ from scripts/gpu-bundle.sh beside it: the GPU tests
# (GPU against the CPU reference), the same under compute-sanitizer, then the attention benchmark;
# with --decode instead, only the end-to-end decode benchmark (strata-bench-decode-gpu, then the
# same workload through Hugging Face transformers at strata's fp16 batch). Logs, CSV and JSON go to
# $OUT (or ./gpu-out). Arguments after -- go to the benchmark that runs.
#   scripts/gpu-run.sh [--no-sanitizer] [--no-bench] [-- ATTENTION BENCH ARGS]
#   scripts/gpu-run.sh --decode [-- DECODE BENCH ARGS]
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
sanitize=1 bench=1 decode=0
while [ $# -gt 0 ]; do
  case "$1" in
    --no-sanitizer) sanitize=0 ;;
    --no-bench) bench=0 ;;
    --decode) decode=1 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
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
# NCCL (for test_transport's NCCL cases) likewise: PyTorch's wheel.
nccl_dir=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null || true)
[ -n "$nccl_dir" ] && cublas_dirs="${cublas_dirs%:}:$nccl_dir"
export LD_LIBRARY_PATH="$PWD/$bundle/lib:${cublas_dirs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="$PATH:/usr/local/cuda/bin"   # compute-sanitizer lives with the toolkit
echo "bundle built from commit $(cat "$bundle/COMMIT")" | tee "$out/summary.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | tee -a "$out/summary.txt"
status=0
if ldd "$bundle/bin/test_cuda_model" | grep -q "not found"; then
  echo "gpu-run: libraries not found:" >&2
  ldd "$bundle/bin/test_cuda_model" | grep "not found" >&2
  exit 1
fi
if [ $decode = 1 ]; then
  "$bundle/bin/strata-bench-decode-gpu" --json "$out/decode.json" "$@" 2>&1 | tee "$out/decode.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  field() { sed -n "s/.*\"$1\":\"\{0,1\}\([^,\"]*\).*/\1/p" "$out/decode.json" 2>/dev/null | head -1; }
  batch=$(grep '"codec":"fp16"' "$out/decode.json" 2>/dev/null | sed -n 's/.*"batch":\([0-9]*\).*/\1/p' | head -1)
  prompt=$(field prompt)
  gen=$(field gen)
  shape=$(sed -n 's/.*"model":"synthetic \([a-z0-9.-]*\) seed.*/\1/p' "$out/decode.json" 2>/dev/null | head -1)
  if [ -n "$batch" ] && [ "$batch" -gt 0 ] && [ -n "$shape" ]; then
    echo "== the same workload through Hugging Face transformers (batch $batch, fp16 cache) =="
    python3 bench/gpu/hf_decode.py --shape "$shape" --batch "$batch" --prompt "$prompt" --gen "$gen" \
      2>"$out/hf.log" | tee "$out/hf.json"
    [ "${PIPESTATUS[0]}" -eq 0 ] || { status=1; tail -n 20 "$out/hf.log"; }
  else
    echo "gpu-run: no fp16 row from a synthetic model in decode.json: the transformers run is skipped" >&2
  fi
  exit $status
fi
# test_cuda_model compares with the CPU on synthetic models, and on the real one when STRATA_MODEL
# names it (the model file does not fit one device call's 64 MiB: docs/gpu.md).
for t in test_cuda_plan test_cuda_ops test_cuda_attention test_cuda_encode test_cuda_sample test_cuda_model; do
  "$bundle/bin/$t" > "$out/$t.log" 2>&1
  rc=$?
  echo "$t: exit $rc" | tee -a "$out/summary.txt"
  [ $rc -eq 0 ] || { status=1; tail -n 30 "$out/$t.log"; }
done
# The NCCL data plane: on one GPU the loopback link (a one-rank communicator sending to itself);
# the two-rank test needs two GPUs and reports itself skipped on one.
if ldd "$bundle/bin/test_transport" | grep -q "libnccl.*not found"; then
  echo "test_transport: no libnccl on this machine (looked in PyTorch's nvidia.nccl wheel): not run" |
    tee -a "$out/summary.txt"
else
  "$bundle/bin/test_transport" > "$out/test_transport.log" 2>&1
  rc=$?
  # Passing without the loopback case having run means it found no device: a failure here.
  if [ $rc -eq 0 ] && ! grep -q "OK \] test_nccl_loopback" "$out/test_transport.log"; then rc=77; fi
  echo "test_transport (NCCL loopback): exit $rc" | tee -a "$out/summary.txt"
  [ $rc -eq 0 ] || { status=1; tail -n 30 "$out/test_transport.log"; }
fi
# A worker's stage on the GPU (test_stage's test_gpu_stage: two stages over TCP against the CPU),
# on a synthetic model of SmolLM2's shape since the model file cannot travel (docs/gpu.md).
STRATA_MODEL=synthetic:smollm2-135m:seed=3 "$bundle/bin/test_stage" > "$out/test_stage.log" 2>&1
rc=$?
if [ $rc -eq 0 ] && grep -q "GPU stage checked for its errors only" "$out/test_stage.log"; then rc=77; fi
echo "test_stage (GPU stages): exit $rc" | tee -a "$out/summary.txt"
[ $rc -eq 0 ] || { status=1; tail -n 30 "$out/test_stage.log"; }
if [ $sanitize = 1 ]; then
  if command -v compute-sanitizer >/dev/null; then
    for t in test_cuda_ops test_cuda_attention test_cuda_encode test_cuda_sample; do
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
