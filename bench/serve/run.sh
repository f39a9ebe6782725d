#!/usr/bin/env bash
# Serving benchmark: builds strata if needed, starts `strata serve` on a free loopback port with
# the default model, runs bench/serve/loadgen.py's concurrency sweep against it, stops it, then
# runs the same requests one after another through single-process `strata generate` (the
# baseline), and writes the results as JSON (plus the report as markdown beside it).
# See bench/serve/README.md.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: bench/serve/run.sh [options] [-- loadgen.py options]

Builds strata and strata-worker if needed, starts `strata serve --listen 127.0.0.1:<free port>`
with the model, runs the load generator's concurrency sweep against it, stops it with SIGTERM,
runs the same requests one after another through `strata generate` (one process each), and
writes the results.

options:
  --build DIR            build folder (default: build); configured (RelWithDebInfo, as
                         scripts/build.sh does) when it has no CMakeCache.txt, then the targets
                         strata and strata-worker are brought up to date
  --no-build             use the binaries in --build as they are
  --model PATH           GGUF model for the server and the baseline (default: $STRATA_MODEL,
                         else models/SmolLM2-135M-Instruct.Q4_1.gguf)
  --out FILE             JSON results (default: bench/serve/results/serve-<UTC time>.json); the
                         markdown report is written beside it as .md
  --concurrency LIST     concurrency levels (default 1,4,16)
  --requests N           requests per level, the same N at every level (default 32)
  --prompt-tokens DIST   prompt length distribution (default uniform:16:128)
  --max-tokens DIST      output length distribution (default uniform:16:64)
  --serve-args "ARGS"    more `strata serve` options, e.g. "--stages 1 --max-seqs 16"
  --baseline-args "ARGS" more `strata generate` options for the baseline, e.g. "--threads 2"
  --no-baseline          skip the sequential baseline
  -h, --help             this help

Everything after `--` goes to bench/serve/loadgen.py (see bench/serve/loadgen.py --help), e.g.
  bench/serve/run.sh --requests 8 -- --timeout 120 --warmup 2
Distributions: N, fixed:N, uniform:A:B, normal:MEAN:SD[:MIN:MAX], choice:A,B,C. Prompts are
words that are one token each on the default model.

With the defaults on a 2-core machine, expect several minutes: every level replays the 32
requests (about 1,300 output tokens), and so does the baseline.
Exit status: loadgen.py's (0 when the run completed, also with failed requests, which are
reported; 1 when the server did not serve or the sweep stopped; 2 bad usage; 130 interrupted).
EOF
}

cd "$(dirname "$0")/../.."

build=build
do_build=1
model=${STRATA_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
out=""
conc=1,4,16
requests=32
prompt_tokens=uniform:16:128
max_tokens=uniform:16:64
serve_args=""
baseline_args=""
baseline=1
extra=()

need() { [ $# -ge 2 ] || { echo "run.sh: $1 needs a value (try --help)" >&2; exit 2; }; }
while [ $# -gt 0 ]; do
  case $1 in
    -h|--help) usage; exit 0 ;;
    --build) need "$@"; build=$2; shift 2 ;;
    --no-build) do_build=0; shift ;;
    --model) need "$@"; model=$2; shift 2 ;;
    --out) need "$@"; out=$2; shift 2 ;;
    --concurrency) need "$@"; conc=$2; shift 2 ;;
    --requests) need "$@"; requests=$2; shift 2 ;;
    --prompt-tokens) need "$@"; prompt_tokens=$2; shift 2 ;;
    --max-tokens) need "$@"; max_tokens=$2; shift 2 ;;
    --serve-args) need "$@"; serve_args=$2; shift 2 ;;
    --baseline-args) need "$@"; baseline_args=$2; shift 2 ;;
    --no-baseline) baseline=0; shift ;;
    --) shift; extra=("$@"); break ;;
    *) echo "run.sh: unknown option '$1' (try --help)" >&2; exit 2 ;;
  esac
done

py=/usr/bin/python3
if [[ ! -x $py ]] || ! "$py" -c 'import grpc, google.protobuf' 2>/dev/null; then
  echo "run.sh: $py with the grpc and protobuf modules is needed (apt-get install python3-grpcio python3-protobuf)" >&2
  exit 1
fi
command -v protoc >/dev/null || { echo "run.sh: protoc is needed (apt-get install protobuf-compiler)" >&2; exit 1; }
if [[ $model != synthetic:* ]]; then
  [ -f "$model" ] || { echo "run.sh: model $model not found; run scripts/setup.sh or pass --model" >&2; exit 1; }
  model=$(cd "$(dirname "$model")" && pwd)/$(basename "$model")
fi

if [ "$do_build" = 1 ]; then
  blog=$(mktemp)
  echo "run.sh: building strata and strata-worker in $build (log: $blog)" >&2
  if { [ -f "$build/CMakeCache.txt" ] || cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo; } >"$blog" 2>&1 &&
     cmake --build "$build" -j"$(nproc)" --target strata strata-worker >>"$blog" 2>&1; then
    rm -f "$blog"
  else
    tail -30 "$blog" >&2
    echo "run.sh: the build failed (full log: $blog)" >&2
    exit 1
  fi
fi
strata=$(cd "$build" && pwd)/strata
[ -x "$strata" ] || { echo "run.sh: $strata not found (build it, or drop --no-build)" >&2; exit 1; }
if ! "$strata" serve --help >/dev/null 2>&1; then
  echo "run.sh: $strata has no 'serve' command (this build predates strata serve)" >&2
  exit 1
fi

if [ -z "$out" ]; then
  mkdir -p bench/serve/results
  out=bench/serve/results/serve-$(date -u +%Y%m%dT%H%M%SZ).json
fi
mkdir -p "$(dirname "$out")"
report=${out%.json}.md
server_log=${out%.json}.server.log

# --start and --baseline are split like a shell would (Python's shlex): quote the paths.
printf -v qstrata '%q' "$strata"
printf -v qmodel '%q' "$model"
args=(--start "$qstrata serve --listen 127.0.0.1:{port} --model $qmodel $serve_args"
      --server-log "$server_log"
      --concurrency "$conc" --requests "$requests" --prompt-tokens "$prompt_tokens" --max-tokens "$max_tokens"
      --json "$out")
if [ "$baseline" = 1 ]; then
  args+=(--baseline "$qstrata generate --model $qmodel $baseline_args")
fi
echo "run.sh: bench/serve/loadgen.py ${args[*]} ${extra[*]:-}" >&2
set +e
"$py" bench/serve/loadgen.py "${args[@]}" "${extra[@]}" | tee "$report"
rc=${PIPESTATUS[0]}
set -e
echo "run.sh: results in $out, report in $report, server log in $server_log (loadgen exit status $rc)" >&2
exit "$rc"
