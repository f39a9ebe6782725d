#!/usr/bin/env bash
# The TCP data plane over loopback (bench/transport_bench.c): one-way throughput per message
# size and the round trip of a decode step's rows. With --baseline REV the same driver is also
# built against REV's transport library (a git worktree, configured like BUILD) and both run
# interleaved, REPS times each; the table gives each side's median and the ratio this tree /
# baseline. Used to price the data plane's encryption against the plaintext stream before it.
# usage: bench/transport.sh [--baseline REV] [DRIVER ARGS...]   (REPS=3, BUILD=build)
set -euo pipefail
cd "$(dirname "$0")/.."
baseline=""
if [ "${1:-}" = "--baseline" ]; then
  [ $# -ge 2 ] || { echo "bench: --baseline needs a git revision" >&2; exit 2; }
  baseline=$2
  shift 2
fi
reps=${REPS:-3}
build=${BUILD:-build}
bin="$build/bench/strata-bench-transport"
[ -x "$bin" ] || { echo "bench: $bin missing; build first (cmake --build $build)" >&2; exit 1; }
out=$(mktemp)
wt=""
cleanup() {
  rm -f "$out"
  if [ -n "$wt" ]; then git worktree remove --force "$wt" >/dev/null 2>&1 || rm -rf "$wt"; fi
}
trap cleanup EXIT

base_bin=""
if [ -n "$baseline" ]; then
  rev=$(git rev-parse --short "$baseline^{commit}") || { echo "bench: no revision '$baseline'" >&2; exit 2; }
  wt=$(mktemp -d /tmp/strata-transport-baseline.XXXXXX)
  rmdir "$wt"
  echo "bench: building the transport library of $rev in $wt" >&2
  git worktree add --detach "$wt" "$rev" >/dev/null 2>&1
  # The driver goes into the worktree as this tree's CMake builds it, so it links the same way.
  cp bench/transport_bench.c "$wt/bench/transport_bench.c"
  grep -q strata-bench-transport "$wt/bench/CMakeLists.txt" || cat >>"$wt/bench/CMakeLists.txt" <<'CMAKE'
find_package(Threads REQUIRED)
add_executable(strata-bench-transport transport_bench.c)
target_include_directories(strata-bench-transport PRIVATE "${CMAKE_SOURCE_DIR}")
target_link_libraries(strata-bench-transport PRIVATE strata_transport Threads::Threads)
CMAKE
  type=$(sed -n 's/^CMAKE_BUILD_TYPE:STRING=//p' "$build/CMakeCache.txt")
  cmake -S "$wt" -B "$wt/build" -DCMAKE_BUILD_TYPE="${type:-RelWithDebInfo}" >/dev/null
  cmake --build "$wt/build" -j"$(nproc)" --target strata-bench-transport >/dev/null
  base_bin="$wt/build/bench/strata-bench-transport"
fi

for r in $(seq 1 "$reps"); do
  echo "bench: round $r of $reps" >&2
  [ -z "$base_bin" ] || "$base_bin" --label "baseline $rev" "$@" >>"$out"
  "$bin" --label "this tree" "$@" >>"$out"
done

python3 - "$out" <<'EOF'
import collections, statistics, sys
runs = collections.defaultdict(list)
units = {}
labels = []
for line in open(sys.argv[1]):
    label, what, value, unit = line.rstrip("\n").split("\t")
    runs[(label, what)].append(float(value))
    units[what] = unit
    if label not in labels:
        labels.append(label)
whats = list(dict.fromkeys(w for (_, w) in runs))
head = ["measurement"] + [f"{l} (median)" for l in labels] + (["this tree / baseline"] if len(labels) > 1 else [])
print("| " + " | ".join(head) + " |")
print("|" + "---|" * len(head))
for w in whats:
    meds = [statistics.median(runs[(l, w)]) for l in labels]
    row = [f"{w} ({units[w]})"] + [f"{m:.3f}" if units[w] == "GB/s" else f"{m:.1f}" for m in meds]
    if len(labels) > 1:
        row.append(f"{meds[-1] / meds[0]:.2f}")
    print("| " + " | ".join(row) + " |")
EOF
