#!/usr/bin/env bash
# deploy/ checked without a GPU, a network, a cluster or the real binaries:
#  - every script parses (bash -n) and, when shellcheck is installed, passes shellcheck -x;
#  - each launcher's --help exits 0 and names every option its parser takes;
#  - --dry-run prints the right commands (one worker per device, CUDA_VISIBLE_DEVICES per worker,
#    secret file flags, ssh copies of the secret), and bad usage exits 2 with a message;
#  - launch-node.sh really runs stub binaries: a worker that exits is restarted, SIGTERM and
#    SIGHUP drain the coordinator before the workers stop, a second signal during the drain is passed
#    on (the coordinator ends its drain) and a third kills a stuck one, a second signal while
#    the workers stop does not cut that short, the generated secret is 0600 and removed at exit, a worker refused
#    for bad usage stops everything with status 2, a SIGKILLed launcher's workers are not
#    restarted, and no process is left behind;
#  - launch-multinode.sh really runs through a stand-in ssh (the secret lands 0600 on each
#    "host" through stdin and is removed at exit, also when the copy to a later host fails);
#  - the flags the deploy files give strata-worker and strata-coordinator exist (in the built
#    binaries' --help when given, else in the sources' option tables);
#  - the Kubernetes manifest parses (/usr/bin/python3 + PyYAML) with the expected objects;
#  - the systemd units pass systemd-analyze verify (ExecStart pointed at stub binaries).
# Parts whose tool is missing say so and are skipped; exit 0 pass, 1 fail, 77 skip.
# usage: tests/deploy/test_deploy.sh [SOURCE_DIR [STRATA_COORDINATOR STRATA_WORKER]]
set -uo pipefail
src=${1:-$(cd "$(dirname "$0")/../.." && pwd)}
deploy=$src/deploy
for tool in od stat mktemp sed grep sort; do
  command -v "$tool" >/dev/null || { echo "test_deploy: SKIP: $tool is missing" >&2; exit 77; }
done
tmp=$(mktemp -d)
trap 'reap >/dev/null; rm -rf "$tmp"' EXIT
failures=0
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }
note() { echo "test_deploy: $*" >&2; }

# expect STATUS PATTERN CMD...: CMD exits STATUS and its stdout+stderr match PATTERN (grep -E).
expect() {
  local status=$1 pattern=$2 got=0
  shift 2
  "$@" >"$tmp/out" 2>&1 || got=$?
  [[ $got == "$status" ]] || fail "$* exited $got, expected $status: $(tail -n 2 "$tmp/out")"
  grep -Eq -- "$pattern" "$tmp/out" || fail "$*: output lacks /$pattern/: $(tail -n 2 "$tmp/out")"
}
# count PATTERN FILE: lines of FILE matching PATTERN (grep -E).
count() {
  local c
  c=$(grep -Ec -- "$1" "$2" 2>/dev/null)
  echo "${c:-0}"
}
# mentions FILE OPTION: FILE names OPTION as a whole word (--host is not --hosts).
mentions() { grep -Eq -- "(^|[^a-z-])$2([^a-z-]|\$)" "$1"; }

# The stubs append "PID PARENT ROLE" to $STUB_PIDS (a worker's parent is its supervisor, the
# coordinator's the launcher). alive PID: PID runs (not a zombie) and is one of this test's
# processes (its command line names $tmp), which guards against a reused pid.
export STUB_PIDS=$tmp/pids
alive() {
  local state
  [[ -r /proc/$1/stat ]] && read -r _ _ state _ <"/proc/$1/stat" 2>/dev/null && [[ $state != Z ]] &&
    tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null | grep -qF -- "$tmp/"
}
# reap: kills what the launchers left running (supervisors first, so that none restarts a
# worker) and prints how many processes that was; 0 after every case that stops cleanly.
reap() {
  local pid ppid p n=0
  [[ -f $STUB_PIDS ]] || { echo 0; return 0; }
  while read -r pid ppid _; do
    for p in "$ppid" "$pid"; do
      if alive "$p"; then
        kill -KILL "$p" 2>/dev/null && n=$((n + 1))
      fi
    done
  done <"$STUB_PIDS"
  echo "$n"
}
# finish PID: waits up to 10 s for the launcher PID to exit (then kills it), its status in rc.
finish() {
  local i
  for ((i = 0; i < 100; i++)); do kill -0 "$1" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$1" 2>/dev/null; then
    fail "launcher $1 did not exit within 10 s: killed"
    kill -KILL "$1"
  fi
  rc=0
  wait "$1" || rc=$?
}
# no_leftovers CASE: nothing of the last run still runs.
no_leftovers() {
  local n
  n=$(reap)
  [[ $n == 0 ]] || fail "$1: $n process(es) were left running (killed now)"
}

node=$deploy/launch-node.sh
multi=$deploy/launch-multinode.sh
scripts=("$node" "$multi" "$deploy/lib/common.sh" "$0")

# ---- syntax and style
for s in "${scripts[@]}"; do
  bash -n "$s" || fail "bash -n $s"
done
if command -v shellcheck >/dev/null; then
  (cd "$deploy" && shellcheck -x --severity=warning launch-node.sh launch-multinode.sh lib/common.sh) ||
    fail "shellcheck deploy/"
  shellcheck --severity=warning "$0" || fail "shellcheck $0"
else
  note "shellcheck not installed: style check skipped"
fi

# ---- stub binaries and tools (a real run of the launchers without strata, ssh or GPUs)
stubs=$tmp/bin
mkdir -p "$stubs"
cat >"$stubs/strata-coordinator" <<'EOF'
#!/usr/bin/env bash
# Stub coordinator: logs its arguments; SIGTERM "drains" for STUB_COORD_DRAIN_TICKS x 0.05 s
# (default 6: 0.3 s) and exits 0; a second SIGTERM during the drain ends it at once (logged
# "TERM again"), as strata-coordinator does.
echo "$$ $PPID coordinator" >>"$STUB_PIDS"
echo "coordinator start $*" >>"$STUB_LOG"
left=-1
on_term() {
  if ((left >= 0)); then
    echo "coordinator TERM again" >>"$STUB_LOG"
    left=0
  else
    echo "coordinator TERM" >>"$STUB_LOG"
    left=${STUB_COORD_DRAIN_TICKS:-6}
  fi
}
# STUB_COORD_STUCK=1: it ignores SIGTERM (a drain that hangs). (Setting the draining trap after
# the ignoring one replaced it: the "stuck" stub drained in 0.3 s, and the test raced the second
# signal against that exit.)
if [[ -n ${STUB_COORD_STUCK:-} ]]; then
  trap '' TERM
else
  trap on_term TERM
fi
while :; do
  sleep 0.05
  if ((left == 0)); then echo "coordinator drained" >>"$STUB_LOG"; exit 0; fi
  ((left < 0)) || left=$((left - 1))
done
EOF
cat >"$stubs/strata-worker" <<'EOF'
#!/usr/bin/env bash
# Stub worker: logs its device, data address and the mode of its secret file. Its first run
# exits 1 at once (a lost control link); later runs wait for SIGTERM. STUB_WORKER_EXIT=N: every
# run exits N at once. STUB_WORKER_STAY=1: the first run waits too. STUB_WORKER_SLOW_STOP=1:
# SIGTERM takes a second (logged "stopped" at the end).
# As the real worker, --device cuda without a visible device fails.
echo "$$ $PPID worker" >>"$STUB_PIDS"
name='' secret='' data='' device=cpu
while (($#)); do
  case $1 in --name) name=$2; shift ;; --secret-file) secret=$2; shift ;; --data) data=$2; shift ;;
    --device) device=$2; shift ;; esac
  shift
done
echo "worker $name start cuda=${CUDA_VISIBLE_DEVICES-unset} data=$data secret_mode=$(stat -c %a "$secret")" >>"$STUB_LOG"
if [[ $device == cuda* && -z ${CUDA_VISIBLE_DEVICES:-} ]]; then
  echo "worker $name --device $device: no CUDA device" >>"$STUB_LOG"
  exit 1
fi
if [[ -n ${STUB_WORKER_EXIT:-} ]]; then exit "$STUB_WORKER_EXIT"; fi
runs=$STUB_LOG.runs-$name
if [[ ! -e $runs && -z ${STUB_WORKER_STAY:-} ]]; then : >"$runs"; exit 1; fi
if [[ -n ${STUB_WORKER_SLOW_STOP:-} ]]; then
  trap 'echo "worker $name TERM" >>"$STUB_LOG"; sleep 1; echo "worker $name stopped" >>"$STUB_LOG"; exit 0' TERM
else
  trap 'echo "worker $name TERM" >>"$STUB_LOG"; exit 0' TERM
fi
while :; do sleep 0.05; done
EOF
# Stand-in ssh: "ssh [-n] [-o OPT]... DEST COMMAND" runs COMMAND with sh in $SSH_HOSTS/HOST
# (as that host's home directory), keeping stdin unless -n. Hosts in SSH_FAIL_HOSTS (spaced)
# are unreachable: exit 255, as ssh after its ConnectTimeout.
cat >"$stubs/ssh" <<'EOF'
#!/usr/bin/env bash
null=0
while (($#)); do
  case $1 in -n) null=1 ;; -o) shift ;; *) break ;; esac
  shift
done
if [[ " ${SSH_FAIL_HOSTS:-} " == *" ${1#*@} "* ]]; then
  echo "ssh: connect to host ${1#*@} port 22: Connection timed out" >&2
  exit 255
fi
home=$SSH_HOSTS/${1#*@}
mkdir -p "$home"
cd "$home" || exit 255
echo "ssh $1 $2" >>"$SSH_HOSTS/log"
if ((null)); then exec env HOME="$home" sh -c "$2" </dev/null; fi
exec env HOME="$home" sh -c "$2"
EOF
chmod +x "$stubs"/*
# nvidia-smi stand-ins: three GPUs (one with MIG instances, listed indented), and none.
mkdir -p "$tmp/smi3" "$tmp/smi0"
cat >"$tmp/smi3/nvidia-smi" <<'EOF'
#!/bin/sh
echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aaaaaaaa-0000-0000-0000-000000000000)"
echo "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-bbbbbbbb-0000-0000-0000-000000000000)"
echo "  MIG 3g.40gb     Device  0: (UUID: MIG-cccccccc-0000-0000-0000-000000000000)"
echo "GPU 2: NVIDIA H100 80GB HBM3 (UUID: GPU-dddddddd-0000-0000-0000-000000000000)"
EOF
printf '#!/bin/sh\nexit 0\n' >"$tmp/smi0/nvidia-smi"
chmod +x "$tmp/smi3/nvidia-smi" "$tmp/smi0/nvidia-smi"
secret=$tmp/cluster.secret
(umask 077 && od -An -tx1 -N32 /dev/urandom | tr -d ' \n' >"$secret")

# ---- --help names every option the parser takes
for s in "$node" "$multi"; do
  mapfile -t flags < <(grep -oE '^ +(-h \| )?--[a-z-]+\)' "$s" | grep -oE -- '--[a-z-]+' | sort -u)
  ((${#flags[@]} >= 10)) || fail "$s: found only ${#flags[@]} options in its parser"
  expect 0 'usage:' "$s" --help
  for f in "${flags[@]}"; do
    mentions "$tmp/out" "$f" || fail "$s --help does not mention $f"
  done
  expect 0 'usage:' "$s" -h
done
# The match is on whole option names: a help naming only --hosts and --gpus-per-host names
# neither --host nor --gpus.
printf '  --hosts LIST\n  --gpus-per-host N\n' >"$tmp/help"
if mentions "$tmp/help" --host || mentions "$tmp/help" --gpus || ! mentions "$tmp/help" --hosts; then
  fail "mentions: not a whole-option match"
fi

# ---- launch-node.sh --dry-run
out=$tmp/dry
"$node" --dry-run --cpu-workers 3 --bin-dir "$stubs" >"$out" 2>&1 || fail "node dry run, 3 CPU workers: $(tail -n 2 "$out")"
[[ $(count '/strata-coordinator ' "$out") == 1 ]] || fail "node dry run: not one coordinator command"
grep -Eq -- "^$stubs/strata-coordinator --secret-file [^ ]+/cluster.secret --control 127.0.0.1:50052 --replicas 3 --stages 1\$" "$out" ||
  fail "node dry run: coordinator command: $(grep coordinator "$out")"
[[ $(count "^env CUDA_VISIBLE_DEVICES= $stubs/strata-worker --coordinator 127.0.0.1:50052 --secret-file [^ ]+/cluster.secret --name [^ ]+-w[0-2]\$" "$out") == 3 ]] ||
  fail "node dry run: not 3 CPU worker commands with an empty CUDA_VISIBLE_DEVICES: $(cat "$out")"
[[ $(grep -oE -- '--secret-file [^ ]+' "$out" | sort -u | wc -l) == 1 ]] || fail "node dry run: workers and coordinator name different secrets"
[[ $(grep -oE -- '--name [^ ]+' "$out" | sort -u | wc -l) == 3 ]] || fail "node dry run: worker names are not distinct"

"$node" --dry-run --gpus 0,1 --secret-file "$secret" >"$out" 2>&1 || fail "node dry run, --gpus 0,1: $(tail -n 2 "$out")"
[[ $(count 'strata-worker ' "$out") == 2 ]] || fail "node dry run --gpus 0,1: not 2 workers"
[[ $(grep -oE 'CUDA_VISIBLE_DEVICES=[^ ]*' "$out" | tr '\n' ' ') == "CUDA_VISIBLE_DEVICES=0 CUDA_VISIBLE_DEVICES=1 " ]] ||
  fail "node dry run --gpus 0,1: CUDA_VISIBLE_DEVICES per worker: $(cat "$out")"
[[ $(count 'strata-worker .* --device cuda:0( |$)' "$out") == 2 ]] || fail "node dry run --gpus 0,1: GPU workers not given --device cuda:0: $(cat "$out")"
[[ $(count "--secret-file $secret( |\$)" "$out") == 3 ]] || fail "node dry run: --secret-file $secret not on all 3 commands"
grep -q -- '--replicas 2 --stages 1' "$out" || fail "node dry run --gpus 0,1: coordinator not told 2 replicas"
grep -q 'would write' "$out" && fail "node dry run: a secret would be generated although --secret-file was given"

"$node" --dry-run --gpus 0,GPU-1234-ab --stages 2 --nvme-dir /nvme/strata --worker-arg --host-kv-mib=64 \
  -- --model /m/x.gguf --listen 0.0.0.0:50051 --stage-layers 19,11 >"$out" 2>&1 ||
  fail "node dry run with stages: $(tail -n 2 "$out")"
# --stage-layers is the coordinator's own (not an abbreviation of --stages): it goes through
grep -q -- '--replicas 1 --stages 2 --model /m/x.gguf --listen 0.0.0.0:50051 --stage-layers 19,11$' "$out" ||
  fail "node dry run: coordinator args after --: $(cat "$out")"
grep -q -- 'CUDA_VISIBLE_DEVICES=GPU-1234-ab .* --nvme-dir /nvme/strata/worker-1 --host-kv-mib=64$' "$out" ||
  fail "node dry run: GPU UUID, spill dir or worker args: $(cat "$out")"

PATH="$tmp/smi3:$PATH" "$node" --dry-run --cpu-workers 1 >/dev/null 2>&1 || fail "node dry run without --bin-dir (binaries not in PATH)"
PATH="$tmp/smi3:$PATH" "$node" --dry-run --secret-file "$secret" >"$out" 2>&1 || fail "node dry run with nvidia-smi: $(tail -n 2 "$out")"
[[ $(grep -oE 'CUDA_VISIBLE_DEVICES=[^ ]*' "$out" | tr '\n' ' ') == "CUDA_VISIBLE_DEVICES=0 CUDA_VISIBLE_DEVICES=1 CUDA_VISIBLE_DEVICES=2 " ]] ||
  fail "node dry run: GPUs from nvidia-smi -L: $(cat "$out")"
PATH="$tmp/smi0:$PATH" expect 2 'no GPU found' "$node" --dry-run

short=$tmp/short.secret
printf 'tooshort\n' >"$short"
expect 2 "unknown option '--bogus'" "$node" --dry-run --bogus
expect 2 '--gpus needs a value' "$node" --dry-run --gpus
expect 2 "'x' is not a GPU index" "$node" --dry-run --gpus 0,x
expect 2 'exclude each other' "$node" --dry-run --gpus 0 --cpu-workers 1
expect 2 "--cpu-workers: '0'" "$node" --dry-run --cpu-workers 0
expect 2 'do not split into replicas of 2' "$node" --dry-run --cpu-workers 3 --stages 2
expect 2 'the launcher sets it' "$node" --dry-run --cpu-workers 2 -- --replicas 2
expect 2 'not HOST:PORT' "$node" --dry-run --cpu-workers 2 --control nowhere
expect 2 "--restart-delay: 'soon'" "$node" --dry-run --cpu-workers 2 --restart-delay soon
expect 2 'not a readable file' "$node" --dry-run --cpu-workers 2 --secret-file "$tmp/missing"
expect 2 'must be 16 to 256 bytes' "$node" --dry-run --cpu-workers 2 --secret-file "$short"
expect 2 'no executable strata-coordinator' "$node" --cpu-workers 2 --bin-dir "$tmp/missing"

# Repeated GPUs (two workers on one GPU) and stray commas are refused, not merged or dropped.
expect 2 "--gpus: '0' is listed twice" "$node" --dry-run --gpus 0,0
expect 2 "--gpus: '1' is listed twice" "$node" --dry-run --gpus 1,01
expect 2 "--gpus: 'GPU-ab' is listed twice" "$node" --dry-run --gpus GPU-ab,1,GPU-ab
expect 2 "--gpus: '0,' is not a comma-separated list" "$node" --dry-run --gpus 0,
expect 2 "--gpus: '0,,1' is not a comma-separated list" "$node" --dry-run --gpus 0,,1
# Restart delays that give no backoff: a worker failing at once would respawn in a tight loop.
expect 2 '--restart-delay: must be at least 1' "$node" --dry-run --cpu-workers 1 --restart-delay 0
expect 2 '--max-restart-delay: 0 is below --restart-delay 1' "$node" --dry-run --cpu-workers 1 --max-restart-delay 0
expect 2 '--max-restart-delay: 2 is below --restart-delay 5' "$node" --dry-run --cpu-workers 1 --restart-delay 5 --max-restart-delay 2
expect 0 'doubling up to 5s' "$node" --dry-run --cpu-workers 1 --restart-delay 5 --max-restart-delay 5
# getopt_long takes unambiguous prefixes: --stage would override the launcher's --stages.
expect 2 '--stage after --: it abbreviates --stages' "$node" --dry-run --cpu-workers 2 -- --stage 2 --replica 1
expect 2 '--rep=1 after --: it abbreviates --replicas' "$node" --dry-run --cpu-workers 2 -- --rep=1
expect 2 '--cont after --: it abbreviates --control' "$node" --dry-run --cpu-workers 2 -- --model m --cont 127.0.0.1:1
expect 2 '--secret after --: it abbreviates --secret-file' "$node" --dry-run --cpu-workers 2 -- --secret x
expect 0 '--steps-in-flight 2 --ctx 512$' "$node" --dry-run --cpu-workers 2 -- --steps-in-flight 2 --ctx 512
# Control ports the workers can dial; an IPv6 host in brackets (the coordinator splits at the
# last colon).
expect 2 "--control: 'h:99999' is not HOST:PORT" "$node" --dry-run --cpu-workers 1 --control h:99999
expect 2 "--control: 'h:0' is not HOST:PORT" "$node" --dry-run --cpu-workers 1 --control h:0
expect 2 "--control: '::1:50052' is not HOST:PORT" "$node" --dry-run --cpu-workers 1 --control ::1:50052
expect 0 "--coordinator '\[::1\]:50052'" "$node" --dry-run --cpu-workers 1 --control '[::1]:50052'

# The secret's bounds are the binaries': 16 to 256 bytes once trailing CR/LF bytes are dropped.
mkdir -p "$tmp/sec"
head -c 257 /dev/zero | tr '\0' x >"$tmp/sec/257"
printf '0123456789abcde\n' >"$tmp/sec/15nl"
{ head -c 256 /dev/zero | tr '\0' x; printf '\r\n'; } >"$tmp/sec/256crlf"
printf '0123456789abcdef\n\n' >"$tmp/sec/16nlnl"
chmod 600 "$tmp/sec"/*
for f in 257 15nl; do
  expect 2 'must be 16 to 256 bytes' "$node" --dry-run --cpu-workers 1 --secret-file "$tmp/sec/$f"
done
for f in 256crlf 16nlnl; do
  expect 0 'strata-coordinator ' "$node" --dry-run --cpu-workers 1 --secret-file "$tmp/sec/$f"
done
# The same files through the real worker, when given: it refuses the first two at once (exit 2)
# and takes the others (still trying to reach a coordinator on a closed port when stopped).
if [[ -n ${3:-} && -x ${3:-} ]] && command -v timeout >/dev/null; then
  for f in 257:2 15nl:2 256crlf:124 16nlnl:124; do
    rc=0
    # A refusal comes at once; an accepted secret leaves it waiting, cut after half a second.
    timeout "$([[ ${f#*:} == 2 ]] && echo 10 || echo 0.5)" "$3" --coordinator 127.0.0.1:53999 \
      --secret-file "$tmp/sec/${f%:*}" --name t >/dev/null 2>&1 || rc=$?
    [[ $rc == "${f#*:}" ]] || fail "strata-worker with secret ${f%:*}: exit $rc, expected ${f#*:} (the launchers' bounds differ)"
  done
fi

# log() cannot end the script when stderr is gone (closed here; a hung-up terminal gives EIO):
# the mode warning must not abort a run.
cp "$secret" "$tmp/sec/open" && chmod 644 "$tmp/sec/open"
rc=0
"$node" --dry-run --cpu-workers 1 --secret-file "$tmp/sec/open" >"$out" 2>&- || rc=$?
if [[ $rc != 0 ]] || ! grep -q 'strata-coordinator ' "$out"; then fail "node dry run with stderr closed: exit $rc after a warning"; fi

# TLS on the control port: the coordinator gets the pair, every worker the CA (the certificate
# unless --control-tls-ca); the launcher owns those flags.
printf 'certificate\n' >"$tmp/ctl.pem"
printf 'key\n' >"$tmp/ctl-key.pem"
printf 'ca\n' >"$tmp/ca.pem"
"$node" --dry-run --cpu-workers 2 --secret-file "$secret" --control-tls-cert "$tmp/ctl.pem" \
  --control-tls-key "$tmp/ctl-key.pem" >"$out" 2>&1 || fail "node dry run with TLS: $(tail -n 2 "$out")"
grep -q -- "--stages 1 --control-tls-cert $tmp/ctl.pem --control-tls-key $tmp/ctl-key.pem\$" "$out" ||
  fail "node dry run with TLS: coordinator: $(cat "$out")"
[[ $(count "strata-worker .* --coordinator-ca $tmp/ctl.pem\$" "$out") == 2 ]] || fail "node dry run with TLS: workers: $(cat "$out")"
expect 0 "--coordinator-ca $tmp/ca.pem" "$node" --dry-run --cpu-workers 1 --control-tls-cert "$tmp/ctl.pem" \
  --control-tls-key "$tmp/ctl-key.pem" --control-tls-ca "$tmp/ca.pem"
expect 2 'go together' "$node" --dry-run --cpu-workers 1 --control-tls-cert "$tmp/ctl.pem"
expect 2 '--control-tls-ca needs --control-tls-cert' "$node" --dry-run --cpu-workers 1 --control-tls-ca "$tmp/ca.pem"
expect 2 "--control-tls-key $tmp/none.pem: not a readable file" "$node" --dry-run --cpu-workers 1 \
  --control-tls-cert "$tmp/ctl.pem" --control-tls-key "$tmp/none.pem"
expect 2 '--control-tls-cert after --: the launcher sets it' "$node" --dry-run --cpu-workers 1 -- --control-tls-cert x
expect 2 '--control-tls after --: it abbreviates --control-tls-cert' "$node" --dry-run --cpu-workers 1 -- --control-tls x

# ---- launch-multinode.sh --dry-run
"$multi" --dry-run --hosts a,u@b --gpus-per-host 2 --control 10.0.0.1:50052 --secret-file "$secret" \
  --remote-bin-dir /opt/strata/bin >"$out" 2>&1 || fail "multinode dry run: $(tail -n 2 "$out")"
[[ $(count "^ssh -o BatchMode=yes -o ConnectTimeout=10 (a|u@b) 'umask 077 && .*cat > .*chmod 600 .*' < $secret\$" "$out") == 2 ]] ||
  fail "multinode dry run: not one 0600 secret copy over stdin per host: $(cat "$out")"
[[ $(count '/opt/strata/bin/strata-worker --coordinator 10.0.0.1:50052 --secret-file .strata/cluster.secret ' "$out") == 4 ]] ||
  fail "multinode dry run: not 4 workers with the remote secret: $(cat "$out")"
for w in "a 0 50060" "a 1 50061" "u@b 0 50060" "u@b 1 50061"; do
  read -r dest gpu port <<<"$w"
  grep -Eq -- "^ssh -n -o BatchMode=yes -o ConnectTimeout=10 $dest 'exec env CUDA_VISIBLE_DEVICES=$gpu .* --data ${dest#*@}:$port --device cuda:0'\$" "$out" ||
    fail "multinode dry run: worker on $dest GPU $gpu port $port: $(cat "$out")"
done
grep -q -- "--secret-file $secret --control 10.0.0.1:50052 --replicas 4 --stages 1" "$out" || fail "multinode dry run: coordinator"

"$multi" --dry-run --host a:0,3 --host b:1 --stages 3 --control 10.0.0.1:50052 --secret-file "$secret" >"$out" 2>&1 ||
  fail "multinode dry run with --host: $(tail -n 2 "$out")"
[[ $(grep -oE '^ssh -n .* (a|b) .*CUDA_VISIBLE_DEVICES=[^ ]*' "$out" | sed -E 's/^ssh -n .* ([ab]) .*(CUDA[^ ]*)$/\1 \2/' | tr '\n' ' ') == \
  "a CUDA_VISIBLE_DEVICES=0 a CUDA_VISIBLE_DEVICES=3 b CUDA_VISIBLE_DEVICES=1 " ]] || fail "multinode dry run: per-host GPU lists: $(cat "$out")"
grep -q -- '--replicas 1 --stages 3' "$out" || fail "multinode dry run: replicas of 3 stages"

"$multi" --dry-run --hosts a,b --cpu-workers-per-host 1 --stages 2 --control 10.0.0.1:50052 --secret-file "$secret" \
  >"$out" 2>&1 || fail "multinode dry run, CPU workers: $(tail -n 2 "$out")"
[[ $(count "^ssh -n .*CUDA_VISIBLE_DEVICES= .*strata-worker " "$out") == 2 ]] || fail "multinode dry run: 2 CPU workers: $(cat "$out")"
grep -q -- '--device' "$out" && fail "multinode dry run: a CPU worker is given --device: $(grep -- --device "$out")"

# With TLS: the CA goes to every host beside the secret (not umask 077: it is no secret), and
# every worker checks the coordinator with it.
"$multi" --dry-run --hosts a,b --gpus-per-host 1 --control 10.0.0.1:50052 --secret-file "$secret" \
  --control-tls-cert "$tmp/ctl.pem" --control-tls-key "$tmp/ctl-key.pem" --control-tls-ca "$tmp/ca.pem" \
  --remote-ca etc/ca.pem >"$out" 2>&1 || fail "multinode dry run with TLS: $(tail -n 2 "$out")"
[[ $(count "^ssh -o BatchMode=yes -o ConnectTimeout=10 (a|b) 'mkdir -p -- etc && cat > etc/ca.pem.tmp && mv -f -- etc/ca.pem.tmp etc/ca.pem' < $tmp/ca.pem\$" "$out") == 2 ]] ||
  fail "multinode dry run with TLS: not one CA copy per host: $(cat "$out")"
[[ $(count "strata-worker .* --coordinator-ca etc/ca.pem'\$" "$out") == 2 ]] || fail "multinode dry run with TLS: workers: $(cat "$out")"
grep -q -- "--control-tls-cert $tmp/ctl.pem --control-tls-key $tmp/ctl-key.pem" "$out" || fail "multinode dry run with TLS: coordinator"
expect 2 "--remote-ca: '.strata/cluster.secret' is where the secret goes" "$multi" --dry-run --host a:0 --control 10.0.0.1:1 \
  --control-tls-cert "$tmp/ctl.pem" --control-tls-key "$tmp/ctl-key.pem" --remote-ca .strata/cluster.secret
expect 2 'go together' "$multi" --dry-run --host a:0 --control 10.0.0.1:1 --control-tls-key "$tmp/ctl-key.pem"
expect 2 '--control-tls-key after --: the launcher sets it' "$multi" --dry-run --host a:0 --control 10.0.0.1:1 -- --control-tls-key k

expect 2 '--control HOST:PORT is required' "$multi" --dry-run --hosts a --gpus-per-host 1
expect 2 "private-network address" "$multi" --dry-run --hosts a --gpus-per-host 1 --control 127.0.0.1:50052
expect 2 "private-network address" "$multi" --dry-run --hosts a --gpus-per-host 1 --control 0.0.0.0:50052
expect 2 'needs --gpus-per-host' "$multi" --dry-run --hosts a --control 10.0.0.1:1
expect 2 'exclude each other' "$multi" --dry-run --hosts a --gpus-per-host 1 --cpu-workers-per-host 1 --control 10.0.0.1:1
expect 2 'is not HOST:GPUS' "$multi" --dry-run --host a --control 10.0.0.1:1
expect 2 'listed twice' "$multi" --dry-run --hosts a --gpus-per-host 1 --host a:2 --control 10.0.0.1:1
expect 2 'not an ssh destination' "$multi" --dry-run --hosts 'a;b' --gpus-per-host 1 --control 10.0.0.1:1
expect 2 "--data-port: '70000'" "$multi" --dry-run --hosts a --gpus-per-host 1 --control 10.0.0.1:1 --data-port 70000
expect 2 'no workers' "$multi" --dry-run --control 10.0.0.1:1
# ~ would reach the remote shell quoted; a name that is loopback here would be a worker's
# data-plane address (Debian maps a host's own name to 127.0.1.1).
# shellcheck disable=SC2088 # the ~ is meant literally
expect 2 "--remote-bin-dir: '~/bin': ~ is not expanded" "$multi" --dry-run --hosts a --gpus-per-host 1 --control 10.0.0.1:1 --remote-bin-dir '~/bin'
# shellcheck disable=SC2088 # the ~ is meant literally
expect 2 "--nvme-dir: '~/spill'" "$multi" --dry-run --hosts a --gpus-per-host 1 --control 10.0.0.1:1 --nvme-dir '~/spill'
expect 2 "'localhost' resolves to 127.0.0.1 .loopback. on this host" "$multi" --dry-run --hosts localhost --gpus-per-host 1 --control 10.0.0.1:1
expect 2 "unknown option '--gpus'" "$multi" --dry-run --gpus 0
expect 2 'the launcher sets it' "$multi" --dry-run --hosts a --gpus-per-host 1 --control 10.0.0.1:1 -- --secret-file x
expect 2 '--stage=2 after --: it abbreviates --stages' "$multi" --dry-run --hosts a --gpus-per-host 1 --control 10.0.0.1:1 -- --stage=2
# A user's ConnectTimeout replaces the default one (ssh would keep the first anyway).
expect 0 ' -o ConnectTimeout=3 a ' "$multi" --dry-run --host a:0 --control 10.0.0.1:1 --ssh-option ConnectTimeout=3
grep -q 'ConnectTimeout=10' "$tmp/out" && fail "multinode dry run: the default ConnectTimeout beside the user's"
# One host twice (whatever the user: same --name and --data port), one GPU twice, stray commas.
expect 2 'host gpu1 is listed twice' "$multi" --dry-run --hosts u@gpu1,v@gpu1 --gpus-per-host 1 --control 10.0.0.1:1
expect 2 'host gpu1 is listed twice' "$multi" --dry-run --hosts gpu1 --gpus-per-host 1 --host GPU1:1 --control 10.0.0.1:1
expect 2 "--host gpu1:0,0: '0' is listed twice" "$multi" --dry-run --host gpu1:0,0 --control 10.0.0.1:1
expect 2 "--host gpu1:0,: '0,' is not a comma-separated list" "$multi" --dry-run --host gpu1:0, --control 10.0.0.1:1
expect 2 "--hosts: 'a,' is not a comma-separated list" "$multi" --dry-run --hosts a, --gpus-per-host 1 --control 10.0.0.1:1
# Loopback in any spelling, ports out of range, an unbracketed IPv6 address.
for c in LOCALHOST:50052 localhost.localdomain:50052 '[::ffff:127.0.0.1]:50052' '[::1]:50052' 127.1.2.3:50052; do
  expect 2 'private-network address' "$multi" --dry-run --host a:0 --control "$c"
done
for c in 10.0.0.1:0 10.0.0.1:65536 ::1:50052 10.0.0.1:050052; do
  expect 2 'is not HOST:PORT' "$multi" --dry-run --host a:0 --control "$c"
done
expect 0 "--control '\[fd00::1\]:50052'" "$multi" --dry-run --host a:0 --control '[fd00::1]:50052'

# ---- launch-node.sh for real, on the stubs
# wait_for PATTERN FILE N: up to 5 s for N lines matching PATTERN.
wait_for() {
  local i
  for ((i = 0; i < 50; i++)); do
    (($(count "$1" "$2") >= $3)) && return 0
    sleep 0.1
  done
  return 1
}
export STUB_LOG=$tmp/run.log SSH_HOSTS=$tmp/hosts
TMPDIR=$tmp "$node" --cpu-workers 2 --bin-dir "$stubs" --restart-delay 1 >"$tmp/run.err" 2>&1 &
pid=$!
wait_for 'worker .* start' "$STUB_LOG" 4 || fail "node run: the workers were not restarted after exiting: $(cat "$STUB_LOG" "$tmp/run.err")"
kill -TERM "$pid"
rc=0
wait "$pid" || rc=$?
[[ $rc == 0 ]] || fail "node run: launcher exited $rc after SIGTERM: $(cat "$tmp/run.err")"
grep -q 'restarting it in 1s' "$tmp/run.err" || fail "node run: no restart message"
[[ $(count 'secret_mode=600' "$STUB_LOG") == 4 ]] || fail "node run: workers did not all see a 0600 secret: $(cat "$STUB_LOG")"
grep -Eq -- "^coordinator start --secret-file $tmp/strata-secret\.[^ /]+/cluster.secret --control 127.0.0.1:50052 --replicas 2 --stages 1\$" "$STUB_LOG" ||
  fail "node run: coordinator arguments: $(head -n 1 "$STUB_LOG")"
order=$(grep -E 'TERM|drained' "$STUB_LOG" | awk '{print $1, $NF}' | tr '\n' ' ')
[[ $order =~ ^'coordinator TERM coordinator drained worker TERM worker TERM '$ ]] ||
  fail "node run: the coordinator must drain before the workers stop, got: $order"
compgen -G "$tmp/strata-secret.*" >/dev/null && fail "node run: the generated secret was left behind"
no_leftovers "node run"

# SIGHUP (terminal closed, ssh lost) drains as SIGTERM does: the launcher must not die at once,
# removing the secret under running workers and leaving the coordinator orphaned.
rm -f "$STUB_LOG"*
TMPDIR=$tmp STUB_WORKER_STAY=1 "$node" --cpu-workers 1 --bin-dir "$stubs" >"$tmp/run.err" 2>&1 &
pid=$!
wait_for 'worker .* start' "$STUB_LOG" 1 || fail "node run (SIGHUP): the worker did not start: $(cat "$tmp/run.err")"
kill -HUP "$pid"
finish "$pid"
[[ $rc == 0 ]] || fail "node run: launcher exited $rc after SIGHUP, expected a drain and 0: $(cat "$tmp/run.err")"
order=$(grep -E 'TERM|drained' "$STUB_LOG" | awk '{print $1, $NF}' | tr '\n' ' ')
[[ $order == 'coordinator TERM coordinator drained worker TERM ' ]] || fail "node run (SIGHUP): no drain, got: $order"
compgen -G "$tmp/strata-secret.*" >/dev/null && fail "node run (SIGHUP): the generated secret was left behind"
no_leftovers "node run (SIGHUP)"

# Output to a pipe whose reader is gone (`launch-node.sh ... | tee log`, tee ended by the same
# Ctrl-C): the launcher must still drain and stop everything, not die of SIGPIPE at its first
# message and leave the coordinator and workers running without a parent.
rm -f "$STUB_LOG"*
STUB_WORKER_STAY=1 "$node" --cpu-workers 1 --bin-dir "$stubs" --secret-file "$secret" > >(head -c 1 >/dev/null) 2>&1 &
pid=$!
wait_for 'worker .* start' "$STUB_LOG" 1 || fail "node run (closed pipe): the worker did not start (launcher gone?)"
sleep 0.3 # the reader has gone: the next messages meet a closed pipe
kill -TERM "$pid" 2>/dev/null || fail "node run (closed pipe): the launcher died before the signal"
finish "$pid"
[[ $rc == 0 ]] || fail "node run (closed pipe): exit $rc after SIGTERM, expected a drain and 0"
order=$(grep -E 'TERM|drained' "$STUB_LOG" | awk '{print $1, $NF}' | tr '\n' ' ')
[[ $order == 'coordinator TERM coordinator drained worker TERM ' ]] || fail "node run (closed pipe): no drain, got: $order"
no_leftovers "node run (closed pipe)"

# A second signal while the workers stop (one takes a second) must not end the launcher before
# they have stopped.
rm -f "$STUB_LOG"*
STUB_WORKER_STAY=1 STUB_WORKER_SLOW_STOP=1 "$node" --cpu-workers 1 --bin-dir "$stubs" --secret-file "$secret" >"$tmp/run.err" 2>&1 &
pid=$!
wait_for 'worker .* start' "$STUB_LOG" 1 || fail "node run (slow stop): the worker did not start: $(cat "$tmp/run.err")"
kill -TERM "$pid"
wait_for 'worker .* TERM' "$STUB_LOG" 1 || fail "node run (slow stop): the worker got no SIGTERM: $(cat "$STUB_LOG")"
kill -TERM "$pid"
finish "$pid"
grep -q 'worker .* stopped' "$STUB_LOG" || fail "node run: a second SIGTERM while the workers stopped made the launcher leave them running"
[[ $rc == 0 ]] || fail "node run (slow stop): exit $rc, expected 0: $(cat "$tmp/run.err")"
no_leftovers "node run (slow stop)"

# The launcher SIGKILLed (no trap runs): its supervisors must not restart workers for ever; the
# coordinator stays until killed (deploy/README.md).
rm -f "$STUB_LOG"*
STUB_WORKER_EXIT=1 "$node" --cpu-workers 1 --bin-dir "$stubs" --secret-file "$secret" --max-restart-delay 1 >"$tmp/run.err" 2>&1 &
pid=$!
wait_for 'worker .* start' "$STUB_LOG" 1 || fail "node run (SIGKILL): the worker did not start: $(cat "$tmp/run.err")"
kill -KILL "$pid"
{ wait "$pid"; } 2>/dev/null # reaped: a zombie would still answer kill -0 (quiet: no "Killed")
sleep 1.5 # past the first restart delay (1 s)
[[ $(count 'worker .* start' "$STUB_LOG") == 1 ]] ||
  fail "node run: workers restarted after the launcher was SIGKILLed: $(cat "$STUB_LOG" "$tmp/run.err")"
grep -q 'the launcher is gone: not restarting it' "$tmp/run.err" || fail "node run (SIGKILL): no message from the supervisor: $(cat "$tmp/run.err")"
read -r cpid _ < <(grep ' coordinator$' "$STUB_PIDS" | tail -n 1)
alive "$cpid" || fail "node run (SIGKILL): the coordinator did not stay up, as deploy/README.md says it does"
read -r _ spid _ < <(grep ' worker$' "$STUB_PIDS" | tail -n 1)
alive "$spid" && fail "node run (SIGKILL): the supervisor still runs"
reap >/dev/null

rm -f "$STUB_LOG"*
STUB_WORKER_EXIT=2 "$node" --cpu-workers 2 --bin-dir "$stubs" --secret-file "$secret" >"$tmp/run.err" 2>&1 &
pid=$!
for ((i = 0; i < 60; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$pid" 2>/dev/null; then
  fail "node run: a worker refused for bad usage did not stop the launcher"
  kill -KILL "$pid"
fi
rc=0
wait "$pid" || rc=$?
[[ $rc == 2 ]] || fail "node run: exit $rc when a worker exits 2, expected 2: $(cat "$tmp/run.err")"
[[ $(count 'worker .* start' "$STUB_LOG") == 2 ]] || fail "node run: a worker that exited 2 was restarted"
grep -q 'bad usage (exit 2): not restarting' "$tmp/run.err" || fail "node run: no message for a worker's bad usage"
no_leftovers "node run (exit 2)"

# A second signal during a long drain is passed on: the coordinator ends its drain at once and
# exits 0; the workers are stopped after it.
rm -f "$STUB_LOG"*
STUB_WORKER_STAY=1 STUB_COORD_DRAIN_TICKS=1200 "$node" --cpu-workers 1 --bin-dir "$stubs" --secret-file "$secret" >"$tmp/run.err" 2>&1 &
pid=$!
wait_for 'worker .* start' "$STUB_LOG" 1 || fail "node run (long drain): the worker did not start"
kill -TERM "$pid"
wait_for 'coordinator TERM' "$STUB_LOG" 1 || fail "node run (long drain): the coordinator got no SIGTERM: $(cat "$tmp/run.err")"
t0=$SECONDS
kill -HUP "$pid" # (not SIGINT: a background job of this script starts with it ignored, for good)
finish "$pid"
[[ $rc == 0 ]] || fail "node run (long drain): exit $rc after two signals, expected 0: $(cat "$tmp/run.err")"
((SECONDS - t0 < 20)) || fail "node run (long drain): the second signal did not end the 60 s drain"
order=$(grep -E 'TERM|drained' "$STUB_LOG" | awk '{print $1, $NF}' | tr '\n' ' ')
[[ $order == 'coordinator TERM coordinator again coordinator drained worker TERM ' ]] ||
  fail "node run (long drain): expected the second signal passed on before the workers stop, got: $order"
grep -q 'second signal: the coordinator ends its drain now' "$tmp/run.err" || fail "node run (long drain): no message for the second signal"
no_leftovers "node run (long drain)"

# A coordinator whose drain hangs: the second SIGTERM is passed on to no effect, the third kills
# it; the launcher still stops the workers and exits with the coordinator's status (137).
rm -f "$STUB_LOG"*
STUB_COORD_STUCK=1 "$node" --cpu-workers 1 --bin-dir "$stubs" --secret-file "$secret" >"$tmp/run.err" 2>&1 &
pid=$!
wait_for 'worker .* start' "$STUB_LOG" 1 || fail "node run (stuck drain): the worker did not start"
kill -TERM "$pid"
sleep 0.3
kill -TERM "$pid"
sleep 0.3
kill -0 "$pid" 2>/dev/null || fail "node run (stuck drain): the launcher ended at the second signal: $(cat "$tmp/run.err")"
kill -TERM "$pid"
rc=0
wait "$pid" || rc=$?
[[ $rc == 137 ]] || fail "node run (stuck drain): exit $rc after three SIGTERMs, expected 137: $(cat "$tmp/run.err")"
grep -q 'third signal: killing the coordinator' "$tmp/run.err" || fail "node run (stuck drain): no message for the third signal"
no_leftovers "node run (stuck drain)"

# ---- launch-multinode.sh for real, through the stand-in ssh (generated secret)
rm -f "$STUB_LOG"*
TMPDIR=$tmp PATH="$stubs:$PATH" "$multi" --hosts h1,me@h2 --cpu-workers-per-host 1 --control 10.9.8.7:50052 \
  --bin-dir "$stubs" --remote-bin-dir "$stubs" --restart-delay 1 --control-tls-cert "$tmp/ctl.pem" \
  --control-tls-key "$tmp/ctl-key.pem" >"$tmp/run.err" 2>&1 &
pid=$!
wait_for 'worker .* start' "$STUB_LOG" 4 || fail "multinode run: workers did not start and restart: $(cat "$STUB_LOG" "$tmp/run.err")"
for h in h1 h2; do
  f=$SSH_HOSTS/$h/.strata/cluster.secret
  [[ -f $f && $(stat -c %a "$f") == 600 && $(stat -c %a "${f%/*}") == 700 ]] || fail "multinode run: secret on $h missing or not 0600 in a 0700 directory"
  grep -q "worker $h-w0 start cuda= data=$h:50060 secret_mode=600" "$STUB_LOG" || fail "multinode run: worker on $h: $(cat "$STUB_LOG")"
done
[[ $(cat "$SSH_HOSTS/h1/.strata/cluster.secret") == "$(cat "$SSH_HOSTS/h2/.strata/cluster.secret")" ]] || fail "multinode run: hosts got different secrets"
for h in h1 h2; do
  cmp -s "$SSH_HOSTS/$h/.strata/control-ca.pem" "$tmp/ctl.pem" || fail "multinode run: the control port's CA is not on $h"
done
kill -TERM "$pid"
rc=0
wait "$pid" || rc=$?
[[ $rc == 0 ]] || fail "multinode run: launcher exited $rc after SIGTERM: $(cat "$tmp/run.err")"
[[ -e $SSH_HOSTS/h1/.strata/cluster.secret || -e $SSH_HOSTS/h2/.strata/cluster.secret ]] &&
  fail "multinode run: the generated secret was left on the hosts"
grep -q 'coordinator drained' "$STUB_LOG" || fail "multinode run: the coordinator was not drained"
no_leftovers "multinode run"

# The copy to h2 fails (unreachable): the copy already on h1 goes too, with the local secret.
rm -rf "$SSH_HOSTS"
rc=0
TMPDIR=$tmp SSH_FAIL_HOSTS=h2 PATH="$stubs:$PATH" "$multi" --hosts h1,h2 --cpu-workers-per-host 1 --control 10.9.8.7:50052 \
  --bin-dir "$stubs" --remote-bin-dir "$stubs" >"$tmp/run.err" 2>&1 || rc=$?
[[ $rc == 1 ]] || fail "multinode run (h2 unreachable): exit $rc, expected 1: $(cat "$tmp/run.err")"
grep -q 'h2: could not copy the cluster secret' "$tmp/run.err" || fail "multinode run (h2 unreachable): no message: $(cat "$tmp/run.err")"
[[ -d $SSH_HOSTS/h1/.strata ]] || fail "multinode run (h2 unreachable): the secret was never copied to h1"
compgen -G "$SSH_HOSTS/h1/.strata/cluster.secret*" >/dev/null && fail "multinode run: a failed copy to h2 left the generated secret on h1"
compgen -G "$tmp/strata-secret.*" >/dev/null && fail "multinode run (h2 unreachable): the local secret was left behind"
no_leftovers "multinode run (h2 unreachable)"

# A worker program missing on a host (exit 127 through env) is not restarted for ever: the
# launcher stops and exits 2, as for bad usage.
rm -rf "$SSH_HOSTS"
rm -f "$STUB_LOG"*
rc=0
TMPDIR=$tmp PATH="$stubs:$PATH" timeout 30 "$multi" --hosts h1 --cpu-workers-per-host 1 --control 10.9.8.7:50052 \
  --bin-dir "$stubs" --remote-bin-dir "$tmp/no-such-dir" >"$tmp/run.err" 2>&1 || rc=$?
[[ $rc == 2 ]] || fail "multinode run (no worker program): exit $rc, expected 2: $(cat "$tmp/run.err")"
grep -q 'exit 127: its program could not be run or was not found: not restarting it' "$tmp/run.err" ||
  fail "multinode run (no worker program): no message: $(cat "$tmp/run.err")"
grep -q 'restarting it in' "$tmp/run.err" && fail "multinode run (no worker program): restarted: $(cat "$tmp/run.err")"
no_leftovers "multinode run (no worker program)"

# ---- every flag the deploy files give the binaries exists: in their --help when the built
# binaries are passed (arguments 2 and 3), else in their option tables in the sources.
flags_of() { grep -oE -- '--[a-z][a-z-]+' || true; }
# known_flags NAME BINARY SOURCE: the options NAME takes, one per line (nothing: unknown).
known_flags() {
  if [[ -n $2 ]]; then
    "$2" --help 2>&1 | flags_of
  elif [[ -f $3 ]]; then
    grep -oE '\{"[a-z][a-z-]+", *(required|no)_argument' "$3" | sed -E 's/^\{"([a-z-]+)".*/--\1/'
  fi
}
# check_flags NAME BINARY SOURCE USED...: every USED option is known.
check_flags() {
  local name=$1 bin=$2 known f
  known=$(known_flags "$1" "$2" "$3")
  shift 3
  if [[ -z $known && -n $bin ]]; then
    fail "$bin --help names no options (not built, or it fails to start?): the flags deploy/ passes $name are unchecked"
    return
  elif [[ -z $known ]]; then
    note "no $name binary given and no source found: its flag check skipped"
    return
  fi
  for f in "$@"; do
    grep -qx -- "$f" <<<"$known" || fail "deploy/ passes $f to $name, which has no such option"
  done
}
worker_used=$( {
  grep -hE '^(ExecStart|STRATA_WORKER_ARGS)=' "$deploy/systemd/strata-worker@.service" "$deploy/systemd/worker.env" | flags_of
  sed -n '/name: worker$/,/volumeMounts/p' "$deploy/k8s/strata.yaml" | grep -oE -- '- --[a-z][a-z-]+' | cut -c3-
  "$node" --dry-run --gpus 0 --nvme-dir /n | grep 'strata-worker ' | sed 's/.*strata-worker //' | flags_of
  "$multi" --dry-run --host a:0 --control 10.0.0.1:1 --nvme-dir /n | grep 'strata-worker ' | sed 's/.*strata-worker //' | flags_of
} | sort -u)
coord_used=$( {
  grep -hE '^(ExecStart|STRATA_COORDINATOR_ARGS)=' "$deploy/systemd/strata-coordinator.service" "$deploy/systemd/coordinator.env" | flags_of
  sed -n '/name: coordinator$/,/volumeMounts/p' "$deploy/k8s/strata.yaml" | grep -oE -- '- --[a-z][a-z-]+' | cut -c3-
  # The ConfigMap's keys are option names with '_' for '-'.
  sed -n '/coordinator.json: |/,/^---/p' "$deploy/k8s/strata.yaml" | grep -oE '^ +"[a-z_]+":' | tr -d ' ":' | tr _ - | sed 's/^/--/'
  "$node" --dry-run --gpus 0 | grep 'strata-coordinator ' | flags_of
  "$multi" --dry-run --host a:0 --control 10.0.0.1:1 | grep 'strata-coordinator ' | flags_of
} | sort -u)
[[ $(wc -w <<<"$worker_used") -ge 5 && $(wc -w <<<"$coord_used") -ge 10 ]] ||
  fail "flag check: too few flags collected (worker: $worker_used; coordinator: $coord_used)"
# shellcheck disable=SC2086 # one option per word
check_flags strata-worker "${3:-}" "$src/worker/cmd/worker_main.c" $worker_used
# shellcheck disable=SC2086
check_flags strata-coordinator "${2:-}" "$src/coordinator/service/serve.c" $coord_used
# A binary that is given but lists nothing (missing, or failing to start) is a failure, not a skip.
saved=$failures
check_flags strata-worker "$tmp/missing/strata-worker" "$src/worker/cmd/worker_main.c" --name 2>/dev/null
got=$((failures - saved))
failures=$saved
((got == 1)) || fail "flag check: a given binary without options was not a failure"

# ---- Kubernetes manifest
if /usr/bin/python3 -c 'import yaml' 2>/dev/null; then
  /usr/bin/python3 - "$deploy/k8s/strata.yaml" <<'EOF' || fail "k8s manifest (above)"
import json, sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
kinds = sorted(d["kind"] for d in docs)
want = sorted(["Secret", "Secret", "ConfigMap", "Deployment", "Service", "Service", "StatefulSet", "NetworkPolicy", "NetworkPolicy"])
errors = []
if kinds != want:
    errors.append(f"kinds {kinds}, expected {want}")
by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
for d in docs:
    if "namespace" in d["metadata"]:
        errors.append(f"{d['kind']} {d['metadata']['name']} sets a namespace")
secret = by[("Secret", "strata-cluster-secret")]["stringData"]["cluster.secret"]
if len(secret) >= 16:
    errors.append("the Secret placeholder is long enough to be accepted as a real secret")
json.loads(by[("ConfigMap", "strata-coordinator-config")]["data"]["coordinator.json"])
coord = by[("Deployment", "strata-coordinator")]["spec"]["template"]["spec"]["containers"][0]
if "readinessProbe" not in coord:
    errors.append("the coordinator has no readiness probe")
svc_ports = {p["name"] for p in by[("Service", "strata-coordinator")]["spec"]["ports"]}
if svc_ports != {"api", "control", "metrics"}:
    errors.append(f"coordinator Service ports {svc_ports}")
sts = by[("StatefulSet", "strata-worker")]["spec"]
w = sts["template"]["spec"]["containers"][0]
if w["resources"]["limits"].get("nvidia.com/gpu") != 1:
    errors.append("a worker does not ask for one GPU")
env = {e["name"]: e for e in w["env"]}
if env.get("POD_IP", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") != "status.podIP":
    errors.append("POD_IP does not come from the downward API")
if not any(a.startswith("--data=$(POD_IP):") for a in w["args"]):
    errors.append("the worker's --data is not the pod IP")
for c, spec in ((coord, by[("Deployment", "strata-coordinator")]["spec"]["template"]["spec"]), (w, sts["template"]["spec"])):
    arg = next(a for a in c["args"] if a.startswith("--secret-file="))
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    vol = mounts.get(arg.split("=", 1)[1].rsplit("/", 1)[0])
    vols = {v["name"]: v for v in spec["volumes"]}
    if not vol or vols[vol].get("secret", {}).get("secretName") != "strata-cluster-secret":
        errors.append(f"{c['name']}: {arg} is not on the cluster secret's volume")
# Control TLS: the coordinator's pair and the workers' CA come from one Secret, the workers
# seeing its certificate only; the placeholders are no PEM.
tls = by[("Secret", "strata-control-tls")]
if tls.get("type") != "kubernetes.io/tls" or any("BEGIN" in v for v in tls["stringData"].values()):
    errors.append("the control TLS Secret is not a kubernetes.io/tls placeholder")
def on_volume(c, spec, flag, keys):
    arg = next((a for a in c["args"] if a.startswith(flag + "=")), None)
    if not arg:
        return f"{c['name']} has no {flag}"
    path = arg.split("=", 1)[1]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    vol = {v["name"]: v for v in spec["volumes"]}.get(mounts.get(path.rsplit("/", 1)[0]), {})
    sec = vol.get("secret", {})
    files = {i["path"]: i["key"] for i in sec.get("items", [])} or {k: k for k in ("tls.crt", "tls.key")}
    if sec.get("secretName") != "strata-control-tls" or files.get(path.rsplit("/", 1)[1]) not in keys:
        return f"{c['name']}: {arg} is not a file of the control TLS Secret"
    if c is w and set(files.values()) != {"tls.crt"}:
        return "workers see more of the control TLS Secret than its certificate"
    return None
cspec = by[("Deployment", "strata-coordinator")]["spec"]["template"]["spec"]
for c, spec, flag, keys in ((coord, cspec, "--control-tls-cert", {"tls.crt"}), (coord, cspec, "--control-tls-key", {"tls.key"}),
                            (w, sts["template"]["spec"], "--coordinator-ca", {"tls.crt"})):
    e = on_volume(c, spec, flag, keys)
    if e:
        errors.append(e)
if not any(a == "--coordinator=strata-coordinator:50052" for a in w["args"]):
    errors.append("workers do not dial strata-coordinator:50052, the name the certificate is made for")
cfg = json.loads(by[("ConfigMap", "strata-coordinator-config")]["data"]["coordinator.json"])
for tier in ("device", "host", "nvme"):
    offer = next((int(a.split("=")[1]) for a in w["args"] if a.startswith(f"--{tier}-kv-mib=")), 0)
    if offer < cfg.get(f"{tier}_kv_mib", 0):
        errors.append(f"workers offer {offer} MiB of {tier} KV, less than the {cfg[tier + '_kv_mib']} granted: refused")
spill = next(a for a in w["args"] if a.startswith("--nvme-dir=")).split("=", 1)[1]
if not any(spill.startswith(m["mountPath"] + "/") for m in w["volumeMounts"] if m["name"] == "spill"):
    errors.append("the worker's --nvme-dir is not on the spill volume")
for e in errors:
    print("k8s:", e, file=sys.stderr)
sys.exit(1 if errors else 0)
EOF
else
  note "/usr/bin/python3 with PyYAML not available: Kubernetes manifest check skipped"
fi

# ---- systemd units
units=$deploy/systemd
grep -q '^Restart=always$' "$units/strata-worker@.service" || fail "strata-worker@: Restart=always missing"
for u in strata-coordinator.service strata-worker@.service; do
  for key in '^KillSignal=SIGTERM$' '^TimeoutStopSec=' '^User=strata$' '^LoadCredential=cluster.secret:/etc/strata/cluster.secret$' \
    '^EnvironmentFile=/etc/strata/' '^ProtectSystem=strict$' '^NoNewPrivileges=yes$'; do
    grep -Eq -- "$key" "$units/$u" || fail "$u: no line matching $key"
  done
done
drain=$(grep -oE -- '--drain-seconds [0-9]+' "$units/coordinator.env" | cut -d' ' -f2)
stop=$(sed -n 's/^TimeoutStopSec=//p' "$units/strata-coordinator.service")
if [[ -z $drain || -z $stop ]] || ((drain >= stop)); then fail "coordinator: --drain-seconds ($drain) must be below TimeoutStopSec ($stop)"; fi
# The coordinator grants its KV budgets to every worker; a worker offering less is refused.
for tier in device host nvme; do
  grant=$(grep -oE -- "--$tier-kv-mib [0-9]+" "$units/coordinator.env" | cut -d' ' -f2)
  offer=$(grep -oE -- "--$tier-kv-mib [0-9]+" "$units/worker.env" | cut -d' ' -f2)
  ((${offer:-0} >= ${grant:-0})) || fail "worker.env offers ${offer:-0} MiB of $tier KV, coordinator.env grants $grant"
done
if command -v systemd-analyze >/dev/null; then
  # verify checks that ExecStart's binary exists: point it at the stubs in a temporary copy.
  mkdir -p "$tmp/units"
  for u in strata-coordinator.service strata-worker@.service; do
    sed "s|/usr/local/bin/|$stubs/|" "$units/$u" >"$tmp/units/$u"
  done
  rc=0
  systemd-analyze verify --man=no "$tmp/units/strata-coordinator.service" "$tmp/units/strata-worker@0.service" \
    >"$tmp/verify" 2>&1 || rc=$?
  # Any complaint about our files (unknown keys are only warnings, exit 0) is a failure; other
  # lines (about the machine this runs on) are shown but tolerated.
  if ((rc)) || grep -q "$tmp/units" "$tmp/verify"; then
    fail "systemd-analyze verify (status $rc): $(cat "$tmp/verify")"
  elif [[ -s $tmp/verify ]]; then
    note "systemd-analyze verify said (not about the units): $(cat "$tmp/verify")"
  fi
else
  note "systemd-analyze not installed: unit verification skipped"
fi

if ((failures)); then
  echo "test_deploy: $failures failure(s)" >&2
  exit 1
fi
echo "test_deploy: OK"
