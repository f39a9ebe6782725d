#!/usr/bin/env bash
# Line coverage of the suite: builds with gcc's --coverage in build-cov/ (RelWithDebInfo, CPU only),
# runs the tests (all, or those matching a ctest -R pattern), and prints each source file of ours
# with the share of its lines that ran and how many did not, lowest first, then the total. A
# file built into several targets counts a line as run when any of them ran it. With --lines
# FILE ... it prints the lines of those files (paths from the repository root) that never ran;
# --no-run reports on what the last run left in build-cov/ without building or testing.
# usage: scripts/coverage.sh [-R PATTERN] [--no-run] [--lines FILE...]
# (after scripts/setup.sh; the build takes as long as a normal one, the tests about 1.3 x)
set -euo pipefail
cd "$(dirname "$0")/.."
pattern=""
run=1
lines=()
while [ $# -gt 0 ]; do
  case $1 in
    -R) [ $# -ge 2 ] || { echo "coverage: -R needs a pattern" >&2; exit 2; }; pattern=$2; shift 2 ;;
    --no-run) run=0; shift ;;
    --lines) shift; lines=("$@"); break ;;
    -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "coverage: unknown argument '$1' (try --help)" >&2; exit 2 ;;
  esac
done
command -v gcov >/dev/null || { echo "coverage: gcov not found (it comes with gcc)" >&2; exit 1; }
dir="$PWD/build-cov"
export OPENBLAS_NUM_THREADS=1
if [ "$run" = 1 ]; then
  scripts/build.sh "$dir" -DSTRATA_CUDA=OFF -DCMAKE_C_FLAGS=--coverage -DCMAKE_EXE_LINKER_FLAGS=--coverage
  find "$dir/" -name '*.gcda' -delete
  ctest --test-dir "$dir" -j"$(nproc)" --timeout 1500 ${pattern:+-R "$pattern"} ||
    echo "coverage: some tests failed; their lines still count" >&2
elif [ ! -d "$dir" ]; then
  echo "coverage: no build-cov/ yet: run without --no-run first" >&2
  exit 1
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
i=0
while IFS= read -r gcda; do
  i=$((i + 1))
  mkdir -p "$out/$i"
  (cd "$out/$i" && gcov -p -o "$(dirname "$gcda")" "$gcda" >/dev/null 2>&1) || true
done < <(find "$dir/" -name '*.gcda')
python3 - "$out" "$PWD" "${lines[@]}" <<'PY'
import glob, os, sys
out, root, wanted = sys.argv[1], sys.argv[2] + '/', sys.argv[3:]
ran = {}   # source -> {line: ran anywhere}
for path in glob.glob(out + '/*/*.gcov'):
    with open(path, errors='replace') as f:
        rows = f.read().split('\n')
    src = rows[0].split('Source:', 1)[-1].strip()
    if not src.startswith(root) or src.startswith(root + 'tests/') or '/build' in src[len(root):]:
        continue
    src = src[len(root):]
    seen = ran.setdefault(src, {})
    for row in rows[1:]:
        parts = row.split(':', 2)
        if len(parts) < 3 or parts[0].strip() == '-':
            continue
        n = int(parts[1])
        seen[n] = seen.get(n, False) or parts[0].strip() not in ('#####', '=====')
if wanted:
    for src in wanted:
        if src not in ran:
            print(f'{src}: no coverage data (not built, or no test ran it)')
            continue
        text = open(os.path.join(root, src)).read().split('\n')
        for n in sorted(k for k, v in ran[src].items() if not v):
            print(f'{src}:{n}: {text[n - 1].strip()}')
    sys.exit(0)
total = sum(len(v) for v in ran.values())
hit = sum(sum(v.values()) for v in ran.values())
for src, seen in sorted(ran.items(), key=lambda kv: sum(kv[1].values()) / len(kv[1])):
    h = sum(seen.values())
    print(f'{100 * h / len(seen):6.1f} % {len(seen) - h:5d} not run  {src}')
print(f'total: {hit} of {total} lines ran ({100 * hit / max(total, 1):.1f} %)')
PY
