#!/usr/bin/env bash
# The KV tiers end to end on the default model: for each codec, `strata generate` with a device
# budget of about 1/8 of the sequence's KV, a small host tier and an NVMe spill directory gives
# exactly the tokens of an unconstrained run, while --stats shows blocks spilled to NVMe and
# restored; plus the errors a user meets with the tier flags and the config file.
# usage: tests/cli/test_tiers.sh PATH/TO/strata
set -uo pipefail
strata=${1:?usage: test_tiers.sh STRATA}
here=$(cd "$(dirname "$0")/../.." && pwd)
text="$here/../shared/papers/kivi.txt"
# shellcheck source=tests/cli/lib.sh
source "$(dirname "$0")/lib.sh"

[ -f "$text" ] || { echo "test_tiers: $text missing (../shared must sit beside the repository)" >&2; exit 1; }
head -c 2600 "$text" > "$tmp/prompt.txt"   # ~670 tokens: 8+ blocks per layer
gen=("$strata" generate -p - -n 8 --no-echo --stats)

# The user errors first (exit 2 with a message, or 1 for a runtime failure), no long runs.
expect 2 "holds no block" "$strata" generate -p hi --kv fp16 --device-kv-mib 0.01 --host-kv-mib 1
expect 2 "needs --nvme-dir" "$strata" generate -p hi --nvme-kv-mib 8
expect 2 "not a number" "$strata" generate -p hi --host-kv-mib lots
expect 2 "host arena: 16777216.0 MiB is more than this machine lets the process have" \
  "$strata" generate -p hi --host-kv-mib 16777216
expect 2 "holds less than one block per layer" "$strata" generate -p hi --kv fp16 --device-kv-mib 0.5
echo '{"host_kv_mib": 1, "nvme_dri": "/tmp/x"}' > "$tmp/typo.json"
expect 2 'unknown key "nvme_dri"' "$strata" generate -p hi --config "$tmp/typo.json"
echo '{"host_kv_mib": 1,' > "$tmp/broken.json"
expect 2 "broken.json: line" "$strata" generate -p hi --config "$tmp/broken.json"
echo '{"device_kv_mib": -3}' > "$tmp/neg.json"
expect 2 '"device_kv_mib" must be a number' "$strata" generate -p hi --config "$tmp/neg.json"
expect 1 "$tmp/no/such/parent" "$strata" generate -p hi -n 2 --nvme-dir "$tmp/no/such/parent/spill"
# Without a host tier a device budget below the sequence fails before the step, clearly.
expect 1 "KV block pool exhausted" "${gen[@]}" --kv kivi2 --device-kv-mib 0.3 < "$tmp/prompt.txt"
grep -q "a larger --device-kv-mib, or a tier below it" "$tmp/err" || fail "no hint after an exhausted pool: $(cat "$tmp/err")"

# mib_of FILE: the total KV MiB an unconstrained run printed with --stats
mib_of() { sed -n 's/.*(total \([0-9.]*\) MiB;.*/\1/p' "$1" | tail -1; }

# Every codec in the normal build; under the sanitizers (about 10x slower here) two that cover the
# config files (JSON, YAML) and a codec with extra sections: the tier code paths they run are the same, and
# the per-codec equality is the normal build's job.
codecs="fp16 kivi2 kivi4 gear2 ott2 tada"
[ "${STRATA_SANITIZED:-0}" = 1 ] && codecs="kivi4 gear2"
for kv in $codecs; do
  "${gen[@]}" --kv "$kv" < "$tmp/prompt.txt" > "$tmp/ref.txt" 2> "$tmp/ref.err" || { fail "$kv reference: $(tail -2 "$tmp/ref.err")"; continue; }
  total=$(mib_of "$tmp/ref.err")
  device=$(python3 -c "print(round($total / 8, 3))")
  if [ "$kv" = kivi4 ]; then
    # the same budgets through the config file
    printf '{"device_kv_mib": %s, "host_kv_mib": 0.5, "nvme_dir": "%s", "nvme_kv_mib": 64}\n' "$device" "$tmp/spill" > "$tmp/tiers.json"
    tiers=(--config "$tmp/tiers.json")
  elif [ "$kv" = gear2 ]; then
    # and through a YAML config file
    printf '# the tiers of this run\ndevice_kv_mib: %s\nhost_kv_mib: 0.5\nnvme_dir: %s\nnvme_kv_mib: 64\n' \
      "$device" "$tmp/spill" > "$tmp/tiers.yaml"
    tiers=(--config "$tmp/tiers.yaml")
  else
    tiers=(--device-kv-mib "$device" --host-kv-mib 0.5 --nvme-dir "$tmp/spill" --nvme-kv-mib 64)
  fi
  "${gen[@]}" --kv "$kv" "${tiers[@]}" < "$tmp/prompt.txt" > "$tmp/tier.txt" 2> "$tmp/tier.err" || { fail "$kv tiered: $(tail -3 "$tmp/tier.err")"; continue; }
  cmp -s "$tmp/ref.txt" "$tmp/tier.txt" || fail "$kv: tiered output differs: '$(head -c 200 "$tmp/tier.txt")' vs '$(head -c 200 "$tmp/ref.txt")'"
  spills=$(sed -n 's/^kv nvme tier: .*; \([0-9]*\) spills.*/\1/p' "$tmp/tier.err")
  restores=$(sed -n 's/^kv nvme tier: .* \([0-9]*\) restores (.*/\1/p' "$tmp/tier.err")
  crc=$(sed -n 's/^kv CRC failures: \([0-9]*\)/\1/p' "$tmp/tier.err")
  [ "${spills:-0}" -gt 0 ] && [ "${restores:-0}" -gt 0 ] || fail "$kv: --stats shows no NVMe spills/restores: $(grep '^kv ' "$tmp/tier.err")"
  [ "${crc:-x}" = 0 ] || fail "$kv: CRC failures '$crc'"
  [ -e "$tmp/spill" ] && [ -n "$(ls -A "$tmp/spill" 2>/dev/null)" ] && fail "$kv: spill files left behind"
  echo "$kv: device $device MiB of $total MiB KV: identical output; $(grep '^kv nvme tier' "$tmp/tier.err")"
done

# A spill file damaged on disk while its blocks are in use: the next read of one fails its check,
# and the run stops with the file and offset named (never a token computed from those bytes).
# The tiers are tight enough that every decode step reads most blocks back from NVMe, so blocks
# written before the damage are read again within a step or two.
# damage DIR: overwrites the first 16 MiB of every spill file under DIR with 0xff
damage() {
  python3 - "$1" <<'PY'
import os, sys
files = [os.path.join(d, f) for d, _, fs in os.walk(sys.argv[1]) for f in fs if f.endswith(".kv")]
assert files, f"no spill file under {sys.argv[1]}"
for path in files:
    with open(path, "r+b") as fh:
        fh.write(b"\xff" * min(os.path.getsize(path), 16 << 20))
        fh.flush()
        os.fsync(fh.fileno())
PY
}
# wait_bytes FILE N PID: waits (up to 600 s) until FILE holds N bytes, or PID has exited
wait_bytes() {
  for _ in $(seq 1 3000); do
    [ "$(stat -c %s "$1" 2>/dev/null || echo 0)" -ge "$2" ] && return 0
    kill -0 "$3" 2>/dev/null || return 1
    sleep 0.2
  done
  return 1
}
tight=(--kv kivi4 --device-kv-mib 0.4 --host-kv-mib 0.5 --nvme-kv-mib 64)
"$strata" generate -p - -n 4000 --ignore-eos --no-echo --stats "${tight[@]}" --nvme-dir "$tmp/damaged" \
  < "$tmp/prompt.txt" > "$tmp/damaged.txt" 2> "$tmp/damaged.err" &
run=$!
if wait_bytes "$tmp/damaged.txt" 40 "$run"; then
  damage "$tmp/damaged"
  wait "$run"; got=$?
  [ "$got" -eq 1 ] || fail "generate over a damaged spill file exited $got, expected 1: $(tail -2 "$tmp/damaged.err")"
  grep -q "damaged/slab-0000.kv offset [0-9]*: restored bytes fail verification" "$tmp/damaged.err" ||
    fail "the damaged spill file is not named: $(tail -3 "$tmp/damaged.err")"
  grep -q "stopped with [0-9]* tokens in the KV cache" "$tmp/damaged.err" || fail "no stop report: $(tail -2 "$tmp/damaged.err")"
  echo "generate over a damaged spill file: $(grep 'fail verification' "$tmp/damaged.err" | head -c 200)"
else
  wait "$run"
  fail "generate with tight tiers produced no text: $(tail -3 "$tmp/damaged.err")"
fi

# Ended by a signal (SIGTERM, SIGHUP; a background job of a script ignores SIGINT) half way:
# the slab file (a GiB here, preallocated) and the spill directory the command made are removed,
# and the command still dies of the signal (128 + its number); a directory that was there stays.
mkdir -m 700 "$tmp/kept"
sigs=(TERM)   # and HUP unless this script was started ignoring it (nohup): so is the command then
(( 16#$(awk '/^SigIgn/ {print $2}' /proc/self/status) & 1 )) || sigs+=(HUP)
for sig in "${sigs[@]}"; do
  for dir in "$tmp/made-$sig" "$tmp/kept"; do
    "$strata" generate -p - -n 4000 --ignore-eos --no-echo "${tight[@]}" --nvme-kv-mib 1024 --nvme-dir "$dir" \
      < "$tmp/prompt.txt" > /dev/null 2> "$tmp/sig.err" &
    run=$!
    for _ in $(seq 1 600); do
      grep -q "KV tiers:" "$tmp/sig.err" && break
      kill -0 "$run" 2>/dev/null || break
      sleep 0.1
    done
    [ -f "$dir/slab-0000.kv" ] || fail "SIG$sig: no slab file in $dir: $(tail -2 "$tmp/sig.err")"
    kill -s "$sig" "$run"
    wait "$run"; got=$?
    want=$((128 + $(kill -l "$sig")))
    [ "$got" -eq "$want" ] || fail "generate ended by SIG$sig exited $got, expected $want"
    if [ "$dir" = "$tmp/kept" ]; then
      [ -d "$dir" ] && [ -z "$(ls -A "$dir")" ] || fail "SIG$sig: $dir is not there and empty: $(ls -A "$dir" 2>&1)"
    else
      [ ! -e "$dir" ] || fail "SIG$sig: the spill directory $dir was left: $(ls -A "$dir" 2>&1)"
    fi
  done
done

# The same under strata serve: the request's KV is recomputed from its tokens (--max-recoveries,
# default 1) and it completes; the log names the damaged file, the server serves the next request
# and its metrics count the failed check and the recovery. (A request whose recoveries are used
# up ends with UNAVAILABLE and that message: test_coord test_lost_replica_recovers.)
"$strata" serve --listen 127.0.0.1:0 --metrics 127.0.0.1:0 "${tight[@]}" --nvme-dir "$tmp/served-spill" \
  2> "$tmp/serve.log" &
server=$!
port=$(serve_port "$tmp/serve.log" "$server")
if [ -z "$port" ]; then
  fail "strata serve with tight tiers did not become ready: $(tail -n 20 "$tmp/serve.log")"
else
  "$strata" generate --server "127.0.0.1:$port" -p - -n 200 --ignore-eos --no-echo \
    < "$tmp/prompt.txt" > "$tmp/served.txt" 2> "$tmp/served.err" &
  client=$!
  if wait_bytes "$tmp/served.txt" 40 "$client"; then
    damage "$tmp/served-spill"
    wait "$client"; got=$?
    [ "$got" -eq 0 ] || fail "a request over a damaged spill file exited $got, expected 0 (recovered): $(tail -2 "$tmp/served.err")"
    grep -q "replica 0 stage [01] (worker local-[01]): .*served-spill/local-[01]/slab-0000.kv offset [0-9]*: restored bytes fail verification: not a block: magic 0xffffffff, expected 0x42564b53 .*; it goes on from its [0-9]* tokens" \
      "$tmp/serve.log" || fail "the server's log does not name the damaged file and the recovery: $(grep -m2 'fail verification\|goes on' "$tmp/serve.log")"
  else
    wait "$client"
    fail "the served request produced no text: $(tail -3 "$tmp/served.err")"
  fi
  "$strata" generate --server "127.0.0.1:$port" -p - -n 8 --no-echo < "$tmp/prompt.txt" > "$tmp/after.txt" 2> "$tmp/after.err" ||
    fail "the server did not serve after the damage: $(tail -2 "$tmp/after.err")"
  "$strata" generate -p - -n 8 --no-echo --kv kivi4 < "$tmp/prompt.txt" > "$tmp/after-local.txt" 2>/dev/null
  cmp -s "$tmp/after.txt" "$tmp/after-local.txt" ||
    fail "served after the damage: '$(head -c 120 "$tmp/after.txt")' vs '$(head -c 120 "$tmp/after-local.txt")'"
  mport=$(sed -n 's/.*ready: serving .* metrics port \([0-9]*\).*/\1/p' "$tmp/serve.log")
  crc=$(python3 -c "import sys, urllib.request
body = urllib.request.urlopen(f'http://127.0.0.1:{sys.argv[1]}/metrics', timeout=10).read().decode()
crc = sum(float(l.split()[1]) for l in body.splitlines() if l.startswith('strata_kv_crc_failures_total'))
rec = sum(float(l.split()[1]) for l in body.splitlines() if l.startswith('strata_requests_recovered_total'))
print(crc if crc >= 1 and rec == 1 else f'crc {crc}, recovered {rec}')" "$mport")
  python3 -c "import sys; float(sys.argv[1])" "${crc:-none}" 2>/dev/null ||
    fail "metrics do not count one failed check and one recovery after the damage: '$crc'"
  echo "serve over a damaged spill file: $(grep -o 'fail verification.*' "$tmp/serve.log" | head -c 200); crc failures $crc"
fi
kill -TERM "$server" 2>/dev/null
wait "$server" || fail "strata serve exited $? after SIGTERM: $(tail -3 "$tmp/serve.log")"
# (under the sanitizers a worker's report would only be in the log: its restart hides it otherwise)
grep -q "Sanitizer\|runtime error" "$tmp/serve.log" && fail "sanitizer report in the serve log: $(grep -m3 "Sanitizer\|runtime error" "$tmp/serve.log")"

if [ "$failures" -ne 0 ]; then
  echo "test_tiers: $failures failure(s)" >&2
  exit 1
fi
echo "test_tiers: all checks passed"
