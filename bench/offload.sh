#!/usr/bin/env bash
# Spill and restore throughput of the NVMe tier (io_uring, O_DIRECT, registered buffers/files,
# durable = batched fdatasync, CRC-verified) beside fio with the same block size, queue depth,
# O_DIRECT and io_uring engine on the same directory, interleaved in one run (REPS repetitions,
# medians reported). fio is installed with apt-get if missing (benchmark only).
#   strata spill   = bench/offload_bench.c writes --total-mib of real KV blocks; a block counts
#                    when written, fdatasync'ed and verified.
#   fio write      = rw=write, no sync (the raw device rate; the ratio is taken against this).
#   fio write+sync = rw=write with fdatasync every QD writes (a durability cost like ours).
#   strata restore = reads every block back and verifies both CRC32Cs; fio read = rw=read (no
#                    check); fio read+crc = rw=read with verify=crc32c-intel verify_only over a file
#                    fio wrote with CRC headers (fio's own checksum of every block, untimed write).
# usage: bench/offload.sh [DIR] [TOTAL_MIB] [QD] [BLOCK_BYTES...]
#        (defaults: /var/tmp/strata-offload-bench 1024 32 16384 65536 1048576; REPS=3;
#         BIN=build/bench/strata-offload-bench)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-/var/tmp/strata-offload-bench}
total=${2:-1024}
qd=${3:-32}
shift 3 2>/dev/null || shift $#
sizes=("$@")
[ ${#sizes[@]} -gt 0 ] || sizes=(16384 65536 1048576)
reps=${REPS:-3}
bin=${BIN:-build/bench/strata-offload-bench}
[ -x "$bin" ] || { echo "bench: $bin missing; build first (cmake --build build)" >&2; exit 1; }
command -v python3 >/dev/null || { echo "bench: python3 needed to read fio's JSON" >&2; exit 1; }
if ! command -v fio >/dev/null; then
  echo "bench: installing fio" >&2
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends fio >/dev/null
fi

mkdir -p "$dir"
cleanup() { rm -rf "$dir/strata" "$dir/fio.dat"; }
trap cleanup EXIT

fio_gbps() {  # rw bs extra...  -> GB/s (10^9 bytes/s)
  local rw=$1 bs=$2
  shift 2
  fio --name=offload --filename="$dir/fio.dat" --size="${total}m" --rw="$rw" --bs="$bs" \
      --iodepth="$qd" --direct=1 --ioengine=io_uring --fixedbufs --registerfiles \
      --numjobs=1 --group_reporting --output-format=json "$@" 2>/dev/null |
    python3 -c "import json,sys; j=json.load(sys.stdin)['jobs'][0]; print('%.3f' % ((j['write']['bw_bytes'] + j['read']['bw_bytes']) / 1e9))"
}
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.0f%%", (b > 0) ? 100 * a / b : 0}'; }

dev=$(df --output=source "$dir" | tail -1)
echo "# strata offload benchmark: $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPU cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)), kernel $(uname -r)"
echo "# directory: $dir on $dev ($(df --output=fstype "$dir" | tail -1 | xargs)); $(fio --version); $total MiB per run, QD $qd, $reps repetitions, medians"
echo "# command: bench/offload.sh $dir $total $qd ${sizes[*]}"
path=""
echo
echo "| block bytes | strata spill GB/s | fio write GB/s | spill / fio | fio write+fdatasync GB/s | strata restore GB/s | fio read GB/s | restore / fio read | fio read+crc GB/s | restore / fio read+crc |"
echo "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
for bs in "${sizes[@]}"; do
  sp=() rs=() fw=() fws=() fr=() frc=()
  for ((r = 0; r < reps; r++)); do
    line=$("$bin" --dir "$dir/strata" --block-bytes "$bs" --qd "$qd" --total-mib "$total")
    sp+=("$(sed -n 's/.*spill_gbps=\([0-9.]*\).*/\1/p' <<<"$line")")
    rs+=("$(sed -n 's/.*restore_gbps=\([0-9.]*\).*/\1/p' <<<"$line")")
    path=$(sed -n 's/.*path="\(.*\)"/\1/p' <<<"$line")
    rm -f "$dir/fio.dat"   # fresh, fallocated file each time, as our slabs are
    fw+=("$(fio_gbps write "$bs")")
    rm -f "$dir/fio.dat"
    fws+=("$(fio_gbps write "$bs" --fdatasync="$qd")")
    fr+=("$(fio_gbps read "$bs")")
    rm -f "$dir/fio.dat"
    fio_gbps write "$bs" --verify=crc32c-intel --do_verify=0 --verify_state_save=0 >/dev/null
    frc+=("$(fio_gbps read "$bs" --verify=crc32c-intel --verify_only --verify_state_load=0)")
  done
  msp=$(median "${sp[@]}") mrs=$(median "${rs[@]}") mfw=$(median "${fw[@]}") mfws=$(median "${fws[@]}") mfr=$(median "${fr[@]}") mfrc=$(median "${frc[@]}")
  echo "| $bs | $msp | $mfw | $(ratio "$msp" "$mfw") | $mfws | $mrs | $mfr | $(ratio "$mrs" "$mfr") | $mfrc | $(ratio "$mrs" "$mfrc") |"
  echo "# $bs: strata spill ${sp[*]}; fio write ${fw[*]}; fio write+fdatasync ${fws[*]}; strata restore ${rs[*]}; fio read ${fr[*]}; fio read+crc ${frc[*]}" >&2
done
echo
echo "# strata path: $path"
