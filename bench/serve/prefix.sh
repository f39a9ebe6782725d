#!/usr/bin/env bash
# Prefix caching side by side: the same requests (a shared document before each short question,
# as a system prompt or a RAG context would be) against `strata serve` without and with
# --prefix-cache-mib, one server after the other in one run, through bench/serve/run.sh. Prints
# time to first token and output throughput of both, and their ratios.
# Usage: bench/serve/prefix.sh [--doc-bytes N] [--requests N] [--concurrency LIST] [--kv SPEC]
#                              [--out DIR] [--no-build]
set -euo pipefail
cd "$(dirname "$0")/../.."

doc_bytes=3000
requests=12
conc=1,4
kv=""
out=""
build_flag=()
need() { [ $# -ge 2 ] || { echo "prefix.sh: $1 needs a value" >&2; exit 2; }; }
while [ $# -gt 0 ]; do
  case $1 in
    -h|--help)
      sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'
      echo "defaults: --doc-bytes 3000 (the start of ../shared/papers/kivi.txt, about 750 tokens),"
      echo "          --requests 12, --concurrency 1,4, --kv: the server's default, --out bench/serve/results/prefix-<time>"
      exit 0 ;;
    --doc-bytes) need "$@"; doc_bytes=$2; shift 2 ;;
    --requests) need "$@"; requests=$2; shift 2 ;;
    --concurrency) need "$@"; conc=$2; shift 2 ;;
    --kv) need "$@"; kv=$2; shift 2 ;;
    --out) need "$@"; out=$2; shift 2 ;;
    --no-build) build_flag=(--no-build); shift ;;
    *) echo "prefix.sh: unknown option '$1' (try --help)" >&2; exit 2 ;;
  esac
done
[[ $doc_bytes =~ ^[1-9][0-9]*$ ]] || { echo "prefix.sh: --doc-bytes must be a positive integer" >&2; exit 2; }
paper=../shared/papers/kivi.txt
[ -r "$paper" ] || { echo "prefix.sh: $paper not found (../shared must sit beside the repository)" >&2; exit 1; }
# The document: whitespace squeezed, so that the prompt is one line of text.
doc=$(head -c "$doc_bytes" "$paper" | tr -s '[:space:]' ' ')
[ -n "$out" ] || out=bench/serve/results/prefix-$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$out"

serve_common="--ctx 2048"
kv_args=()
[ -z "$kv" ] || kv_args=(--kv-codec "$kv")
for mode in off on; do
  extra=""
  [ "$mode" = on ] && extra="--prefix-cache-mib 256"
  echo "prefix.sh: prefix caching $mode" >&2
  bench/serve/run.sh "${build_flag[@]}" --no-baseline --requests "$requests" --concurrency "$conc" \
    --prompt-tokens uniform:8:24 --max-tokens fixed:16 --serve-args "$serve_common $extra" \
    --out "$out/$mode.json" -- --prompt-prefix "$doc" --warmup 1 "${kv_args[@]}" >/dev/null
  build_flag=(--no-build)
done

/usr/bin/python3 - "$out" <<'EOF'
import json, sys
d = sys.argv[1]
runs = {m: json.load(open(f"{d}/{m}.json")) for m in ("off", "on")}
print("| concurrency | prefix cache | prompt tokens | cached tokens | TTFT p50 ms | TTFT p90 ms | output tok/s |")
print("|---|---|---|---|---|---|---|")
rows = {}
for m, r in runs.items():
    for lv in r["levels"]:
        s = lv["summary"]
        rows[(lv["concurrency"], m)] = s
for (c, m), s in sorted(rows.items()):
    print(f"| {c} | {m} | {s['prompt_tokens']} | {s['cached_tokens']} | {s['ttft_s']['p50'] * 1e3:.0f} | "
          f"{s['ttft_s']['p90'] * 1e3:.0f} | {s['output_tokens_per_s']:.1f} |")
for c in sorted({c for c, _ in rows}):
    off, on = rows.get((c, "off")), rows.get((c, "on"))
    if off and on and on["ttft_s"]["p50"] and off["output_tokens_per_s"]:
        print(f"concurrency {c}: TTFT p50 {off['ttft_s']['p50'] / on['ttft_s']['p50']:.2f}x lower with the cache, "
              f"output throughput {on['output_tokens_per_s'] / off['output_tokens_per_s']:.2f}x")
EOF
echo "prefix.sh: results in $out" >&2
