#!/usr/bin/env bash
# On a GPU machine, with build-gpu-bundle/ from scripts/gpu-bundle.sh beside it, runs in one call
# (a lent machine is given back 30 s after a call, so the phases go together):
#   tests      the GPU tests (GPU against the CPU reference), the NCCL loopback, GPU stages
#   attention  strata-bench-attention (ATTENTION ARGS)
#   decode     strata-bench-decode-gpu (DECODE ARGS), then the same workload through Hugging Face
#              transformers at strata's fp16 batch
#   cli        `strata generate --device cuda` as a program (SmolLM2-shaped synthetic model, fp16
#              and kivi2 caches), its greedy text set beside the CPU's; with the default model
#              carried (docs/gpu.md), `strata serve` over four `strata-worker --device cuda:0`
#              (tests/fakecuda/test_serve.sh: served text equal to the CPU's, a drain migrating a
#              running request between GPU workers)
#   sanitizer  the kernel tests under compute-sanitizer (memcheck, racecheck); STRATA_SANITIZER_TESTS
#              names which (default: test_cuda_attention test_cuda_ops test_cuda_sample test_cuda_encode
#              test_cuda_weights test_cuda_uploads)
#   profile    Nsight Compute (ncu), when the machine has it, on one launch of the decode attention
#              (PROFILE ARGS: the benchmark's arguments; --profile-kernel REGEX picks the kernel):
#              profile.txt (the sections) and profile.tgz (the report, and its per-instruction
#              source page as CSV)
# Every step has a time limit, cut to what is left of --budget, so a hang costs one step, not the
# call. Logs (packed into logs.tgz at the end), CSV and JSON go to $OUT (or ./gpu-out);
# summary.txt is printed last.
#   scripts/gpu-run.sh [--phases LIST] [--budget SECONDS] [--attention-args "ARGS"]
#                      [--decode-args "ARGS"] [--profile-args "ARGS"] [--profile-kernel REGEX]
#   default: --phases tests,attention,decode,cli,sanitizer --budget 540, with the benchmark subsets
#   that fit one call beside the tests (session 8 timings on an H100):
#     --attention-args "--codecs fp16,kivi2,kivi4,gear2 --contexts 4096,32768,131072 --batches 1,64
#                       --reps 10 --compare staged"
#     --decode-args "--codecs fp16,kivi2,gear2 --kv-budget-gib 4 --prompt 4096 --gen 32 --phases"
#       (sessions 8-9 used --codecs fp16,kivi4,kivi2 and 512-token prompts; docs/gpu.md says why
#       the prompts grew)
#     --profile-args "--codecs kivi2 --contexts 32768 --batches 64 --reps 1" --profile-kernel attend_mma
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
phases=tests,attention,decode,cli,sanitizer budget=540
attention_args="--codecs fp16,kivi2,kivi4,gear2 --contexts 4096,32768,131072 --batches 1,64 --reps 10 --compare staged"
decode_args="--codecs fp16,kivi2,gear2 --kv-budget-gib 4 --prompt 4096 --gen 32 --phases"
profile_args="--codecs kivi2 --contexts 32768 --batches 64 --reps 1" profile_kernel=attend_mma
while [ $# -gt 0 ]; do
  case "$1" in
    --phases) phases=$2; shift ;;
    --budget) budget=$2; shift ;;
    --attention-args) attention_args=$2; shift ;;
    --decode-args) decode_args=$2; shift ;;
    --profile-args) profile_args=$2; shift ;;
    --profile-kernel) profile_kernel=$2; shift ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) echo "gpu-run: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
case ",$phases," in *,tests,*|*,attention,*|*,decode,*|*,cli,*|*,sanitizer,*|*,profile,*) ;;
  *) echo "gpu-run: --phases names none of tests,attention,decode,cli,sanitizer,profile" >&2; exit 2 ;; esac
want() { case ",$phases," in *",$1,"*) return 0 ;; esac; return 1; }
[ -f build-gpu-bundle/bundle.txz ] ||
  { echo "gpu-run: build-gpu-bundle/bundle.txz missing: run scripts/gpu-bundle.sh first" >&2; exit 2; }
bundle=$(mktemp -d /tmp/strata-gpu-bundle.XXXXXX) || exit 1
# tar needs the xz program for .txz; Python's tarfile (lzma) unpacks it where xz is missing.
{ tar xJf build-gpu-bundle/bundle.txz -C "$bundle" 2>/dev/null ||
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2])' \
      build-gpu-bundle/bundle.txz "$bundle"; } || { echo "gpu-run: cannot unpack the bundle" >&2; exit 1; }
out=${OUT:-gpu-out}
mkdir -p "$out"
start=$(date +%s)
# cuBLAS is not carried (600 MiB): the machine's CUDA toolkit, or the pip wheel PyTorch uses.
lib_dirs=
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && lib_dirs+="$d:"
done
lib_dirs+=$(python3 -c 'import nvidia.cublas, os; print(os.path.join(list(nvidia.cublas.__path__)[0], "lib"))' 2>/dev/null || true)
# NCCL (for test_transport's NCCL cases) likewise: PyTorch's wheel.
nccl_dir=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null || true)
[ -n "$nccl_dir" ] && lib_dirs="${lib_dirs%:}:$nccl_dir"
export LD_LIBRARY_PATH="$bundle/lib:${lib_dirs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="$PATH:/usr/local/cuda/bin"   # compute-sanitizer lives with the toolkit
echo "bundle built from commit $(cat "$bundle/COMMIT")" | tee "$out/summary.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | tee -a "$out/summary.txt"
if ldd "$bundle/bin/test_cuda_model" | grep -q "not found"; then
  echo "gpu-run: libraries not found:" >&2
  ldd "$bundle/bin/test_cuda_model" | grep "not found" >&2
  exit 1
fi
# The default model, when every part scripts/gpu-model-parts.sh made has come (over several calls).
real_model=
if [ -f build-gpu-model/SHA256 ]; then
  cat build-gpu-model/part.* > "$bundle/model.gguf" 2>/dev/null
  if [ "$(sha256sum "$bundle/model.gguf" | cut -d' ' -f1)" = "$(cat build-gpu-model/SHA256)" ]; then
    real_model=$bundle/model.gguf
    echo "default model $(cat build-gpu-model/NAME): every part here, checksum good" | tee -a "$out/summary.txt"
  else
    echo "default model: parts missing or damaged ($(ls build-gpu-model | tr '\n' ' ')): synthetic models only" |
      tee -a "$out/summary.txt"
    rm -f "$bundle/model.gguf"
  fi
fi
status=0
# The device tool brings back at most 8 files: on exit every log goes into logs.tgz, and the
# summary, CSV and JSON stay beside it.
pack_logs() {
  (cd "$out" && tar czf logs.tgz --exclude logs.tgz -- *.log *.txt 2>/dev/null &&
     find . -maxdepth 1 -type f \( -name '*.log' -o -name 'generate-*.txt' \) -delete)
  rm -rf "$bundle"
}
trap pack_logs EXIT
# step NAME LIMIT LOG CMD...: runs CMD with at most LIMIT seconds (less if the budget is nearly
# spent), its output in LOG; records "NAME: exit N (S s)" in the summary.
step() {
  local name=$1 limit=$2 log=$3; shift 3
  local left=$(( budget - ($(date +%s) - start) ))
  if [ "$left" -lt 15 ]; then
    echo "$name: not run (budget spent)" | tee -a "$out/summary.txt"; status=1; return 1
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0; t0=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$log" 2>&1
  local rc=$?
  [ $rc -eq 124 ] && echo "(killed after $limit s)" >> "$log"
  STEP_RC=$rc
  echo "$name: exit $rc ($(( $(date +%s) - t0 )) s)" | tee -a "$out/summary.txt"
  if [ $rc -ne 0 ]; then status=1; tail -n 30 "$log"; fi
  return $rc
}

if want tests; then
  # The test programs run side by side (each mostly waits on its CPU reference; the machine has
  # 16 cores), each with its own time limit; their results are reported in order afterwards.
  # test_cuda_model compares with the CPU on synthetic models, and with test_cuda_weights on the
  # real one when its parts came (scripts/gpu-model-parts.sh: it does not fit one call's 64 MiB).
  # test_transport: the NCCL data plane, on one GPU its loopback link (the two-rank case needs two
  # GPUs and reports itself skipped). test_stage: a worker's stage on the GPU (two stages over TCP
  # against the CPU) on a synthetic model of SmolLM2's shape, since the model file cannot travel.
  tests=(test_cuda_plan test_cuda_ops test_cuda_attention test_cuda_encode test_cuda_sample test_cuda_model
         test_cuda_weights test_cuda_uploads)
  if ldd "$bundle/bin/test_transport" | grep -q "libnccl.*not found"; then
    echo "test_transport: no libnccl on this machine (looked in PyTorch's nvidia.nccl wheel): not run" |
      tee -a "$out/summary.txt"
  else
    tests+=(test_transport)
  fi
  tests+=(test_stage)
  left=$(( budget - ($(date +%s) - start) ))
  limit=$(( left < 300 ? left : 300 ))
  t0=$(date +%s)
  for t in "${tests[@]}"; do
    model=
    [ "$t" = test_stage ] && model=synthetic:smollm2-135m:seed=3
    case "$t" in test_cuda_model|test_cuda_weights) model=$real_model ;; esac
    ( env ${model:+STRATA_MODEL=$model} timeout -k 5 "$limit" "$bundle/bin/$t" > "$out/$t.log" 2>&1
      echo $? > "$out/$t.rc" ) &
  done
  wait
  for t in "${tests[@]}"; do
    rc=$(cat "$out/$t.rc"); rm -f "$out/$t.rc"
    [ "$rc" = 124 ] && echo "(killed after $limit s)" >> "$out/$t.log"
    # Passing without its GPU case having run means it found no device: a failure here.
    if [ "$rc" = 0 ] && [ "$t" = test_transport ] && ! grep -q "OK \] test_nccl_loopback" "$out/$t.log"; then rc=77; fi
    if [ "$rc" = 0 ] && [ "$t" = test_stage ] && grep -q "GPU stage checked for its errors only" "$out/$t.log"; then rc=77; fi
    echo "$t: exit $rc" | tee -a "$out/summary.txt"
    if [ "$rc" != 0 ]; then status=1; tail -n 30 "$out/$t.log"; fi
  done
  echo "tests: $(( $(date +%s) - t0 )) s side by side" | tee -a "$out/summary.txt"
fi

if want attention; then
  # shellcheck disable=SC2086 # the arguments are words
  step "strata-bench-attention $attention_args" 240 "$out/attention.txt" \
    "$bundle/bin/strata-bench-attention" --csv "$out/attention.csv" $attention_args
  tail -n 40 "$out/attention.txt"
fi

if want decode; then
  # shellcheck disable=SC2086
  step "strata-bench-decode-gpu $decode_args" 300 "$out/decode.txt" \
    "$bundle/bin/strata-bench-decode-gpu" --json "$out/decode.json" $decode_args
  cat "$out/decode.txt"
  field() { sed -n "s/.*\"$1\":\"\{0,1\}\([^,\"]*\).*/\1/p" "$out/decode.json" 2>/dev/null | head -1; }
  batch=$(grep '"codec":"fp16"' "$out/decode.json" 2>/dev/null | sed -n 's/.*"batch":\([0-9]*\).*/\1/p' | head -1)
  prompt=$(field prompt)
  gen=$(field gen)
  shape=$(sed -n 's/.*"model":"synthetic \([a-z0-9.-]*\) seed.*/\1/p' "$out/decode.json" 2>/dev/null | head -1)
  if [ -n "$batch" ] && [ "$batch" -gt 0 ] && [ -n "$shape" ]; then
    step "transformers, batch $batch, fp16 cache" 240 "$out/hf.log" \
      env PYTHONUNBUFFERED=1 python3 bench/gpu/hf_decode.py --shape "$shape" --batch "$batch" --prompt "$prompt" --gen "$gen"
    grep '^{' "$out/hf.log" | tee "$out/hf.json"
  else
    echo "gpu-run: no fp16 row from a synthetic model in decode.json: the transformers run is skipped" |
      tee -a "$out/summary.txt"
  fi
fi

if want cli; then
  # The program end to end: exit status and text. The GPU holds fp16 weights where the CPU keeps
  # fp32, so on random weights a greedy pick may differ (test_cuda_model bounds the logits); the
  # comparison is reported, the exit status decides.
  model=synthetic:smollm2-135m:seed=3
  for kv in fp16 kivi2; do
    step "strata generate --device cuda --kv $kv" 120 "$out/generate-$kv.log" bash -c \
      '"$1" generate --model "$2" --prompt "The capital of France is" --device cuda -n 32 --kv "$3" --no-echo \
         --stats > "$4.gpu.txt" && "$1" generate --model "$2" --prompt "The capital of France is" -n 32 --kv "$3" \
         --no-echo > "$4.cpu.txt"' _ "$bundle/bin/strata" "$model" "$kv" "$out/generate-$kv" &&
      if cmp -s "$out/generate-$kv.gpu.txt" "$out/generate-$kv.cpu.txt"; then
        echo "  greedy text ($kv): GPU equals CPU" | tee -a "$out/summary.txt"
      else
        echo "  greedy text ($kv): GPU '$(head -c 120 "$out/generate-$kv.gpu.txt")' CPU '$(head -c 120 "$out/generate-$kv.cpu.txt")'" |
          tee -a "$out/summary.txt"
      fi
  done
  if [ -n "$real_model" ]; then
    step "strata serve over four strata-worker --device cuda:0 (test_serve.sh)" 240 "$out/serve.log" \
      env STRATA_MODEL="$real_model" bash tests/fakecuda/test_serve.sh "$bundle/bin/strata" "$bundle/bin/strata-worker"
  else
    echo "  strata serve on GPU workers: skipped (needs the default model: carry its parts, docs/gpu.md)" |
      tee -a "$out/summary.txt"
  fi
fi

if want sanitizer; then
  if command -v compute-sanitizer >/dev/null; then
    # test_cuda_attention under the sanitizer: its group-shape cases only (every compiled variant of
    # the staged kernel, the generic kernel's widest groups and head_dim 256); the whole program
    # with its CPU references would not fit the call.
    for t in ${STRATA_SANITIZER_TESTS:-test_cuda_attention test_cuda_ops test_cuda_sample test_cuda_encode test_cuda_weights test_cuda_uploads}; do
      filter=
      [ "$t" = test_cuda_attention ] && filter=${STRATA_SANITIZER_FILTER:-test_group_shapes}
      for tool in memcheck racecheck; do
        step "$t${filter:+ ($filter)} under compute-sanitizer $tool" 120 "$out/$t.$tool.log" \
          env ${filter:+STRATA_TEST_FILTER=$filter} compute-sanitizer --tool "$tool" --error-exitcode 99 "$bundle/bin/$t"
      done
    done
  else
    echo "compute-sanitizer not found: sanitizer runs skipped" | tee -a "$out/summary.txt"
  fi
fi

if want profile; then
  if command -v ncu >/dev/null; then
    # One launch of the kernel: where its warps stall, how busy each pipe is, what it reads, and
    # per SASS instruction (with its source line: the kernels are built with -lineinfo) how often
    # it ran and stalled. The clocks stay as they are (the workplace's METHOD.md).
    # shellcheck disable=SC2086
    step "ncu on strata-bench-attention $profile_args" 240 "$out/profile-run.log" \
      ncu --clock-control none --kernel-name "regex:$profile_kernel" --launch-count 1 --import-source yes \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
        --section InstructionStats --section SourceCounters -f -o "$out/profile" \
        "$bundle/bin/strata-bench-attention" $profile_args
    if [ -f "$out/profile.ncu-rep" ]; then
      ncu --import "$out/profile.ncu-rep" --page details > "$out/profile.txt" 2>&1
      grep -vE '^(==PROF==|  *-+ *$)' "$out/profile.txt" | tail -n 120
      # Per instruction with its CUDA line; older ncu versions without --print-source give SASS only.
      ncu --import "$out/profile.ncu-rep" --page source --csv --print-source cuda,sass > "$out/profile-source.csv" \
        2> "$out/profile-source.log" ||
        ncu --import "$out/profile.ncu-rep" --page source --csv > "$out/profile-source.csv" 2>> "$out/profile-source.log" ||
        echo "ncu: no source page ($(head -c 300 "$out/profile-source.log"))" | tee -a "$out/summary.txt"
      (cd "$out" && tar czf profile.tgz profile.ncu-rep profile-source.csv 2>/dev/null &&
         rm -f profile.ncu-rep profile-source.csv)
    fi
  else
    echo "ncu not found: profile skipped" | tee -a "$out/summary.txt"
  fi
fi

echo "== summary ($(( $(date +%s) - start )) s) =="
cat "$out/summary.txt"
exit $status
