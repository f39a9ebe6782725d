# shellcheck shell=bash
# Shared by deploy/launch-node.sh and deploy/launch-multinode.sh (sourced, never run): argument
# helpers, the cluster secret, and the supervision of one coordinator plus its workers.
#
# The sourcing script sets PROG (its name, for messages), RESTART_DELAY and MAX_RESTART_DELAY
# (seconds), COORD_CMD (an array: the coordinator's command line) and N_WORKERS, and defines
# worker_command K, which fills the array WCMD with worker K's command line (an environment
# prefix goes through `env`, so the same array can be printed and run).

# A write to a closed pipe must not kill the launcher: under `launch-node.sh ... | tee log`, a
# Ctrl-C ends tee too, and the first message of the drain then raised SIGPIPE before any child
# was signalled, leaving the coordinator and workers running without a parent. (The strata
# binaries ignore SIGPIPE themselves.)
trap '' PIPE

# A message must never stop the script: under set -e a write to a hung-up terminal (EIO) or a
# closed stderr would otherwise end the launcher in the middle of a drain.
log() { printf '%s: %s\n' "$PROG" "$*" >&2 || true; }

# Bad usage: a message and exit 2, like the strata binaries.
usage_error() {
  printf '%s: %s (try --help)\n' "$PROG" "$*" >&2 || true
  exit 2
}

# need_value OPTION ARGC: an option that takes a value must have one.
need_value() { (($2 >= 2)) || usage_error "$1 needs a value"; }

# A decimal number without leading zeros (bash reads 08 as bad octal), at most 9 digits.
is_uint() { [[ $1 =~ ^(0|[1-9][0-9]{0,8})$ ]]; }
is_pos() { [[ $1 =~ ^[1-9][0-9]{0,8}$ ]]; }

# The checks both launchers make of the options they share: --stages ($1) and the restart delays.
# A delay of 0, or a maximum below the first delay, would respawn a worker that fails at once in
# a tight loop.
check_shared_options() {
  is_pos "$1" || usage_error "--stages: '$1' is not a positive integer"
  is_uint "$RESTART_DELAY" || usage_error "--restart-delay: '$RESTART_DELAY' is not a whole number of seconds"
  is_uint "$MAX_RESTART_DELAY" || usage_error "--max-restart-delay: '$MAX_RESTART_DELAY' is not a whole number of seconds"
  ((RESTART_DELAY >= 1)) || usage_error "--restart-delay: must be at least 1 second (a failing worker would respawn in a tight loop)"
  ((MAX_RESTART_DELAY >= RESTART_DELAY)) ||
    usage_error "--max-restart-delay: $MAX_RESTART_DELAY is below --restart-delay $RESTART_DELAY"
}

# split_list OPTION VALUE: VALUE's comma-separated items into the array LIST. An empty item (a
# leading, doubled or trailing comma) means a malformed list, not an item to skip: `read` would
# silently drop a trailing one.
split_list() {
  [[ -n $2 && $2 != ,* && $2 != *, && $2 != *,,* && $2 != *$'\n'* ]] ||
    usage_error "$1: '$2' is not a comma-separated list (an empty item?)"
  # shellcheck disable=SC2034 # for the sourcing script
  IFS=, read -r -a LIST <<<"$2"
}

# first_dup WORD...: prints the first word that occurs twice (nothing if none). The words are
# never empty (an associative array refuses an empty key).
first_dup() {
  local -A seen=()
  local w
  for w in "$@"; do
    if [[ -n ${seen[$w]+x} ]]; then
      printf '%s\n' "$w"
      return 0
    fi
    seen[$w]=1
  done
}

# gpu_key G: what identifies a GPU of --gpus in a comparison: 01 and 1 are the same index.
gpu_key() {
  if [[ $1 =~ ^0*([0-9]+)$ ]]; then printf '%s\n' "${BASH_REMATCH[1]}"; else printf '%s\n' "$1"; fi
}

# check_gpus OPTION DEVICE...: every device a GPU index or UUID, none given twice (two workers on
# one GPU would compete for its memory, and the same worker name and data port on a host clash).
check_gpus() {
  local opt=$1 g keys=() dup
  shift
  for g in "$@"; do
    [[ $g =~ ^([0-9]+|(GPU|MIG)-[A-Za-z0-9/-]+)$ ]] || usage_error "$opt: '$g' is not a GPU index or UUID"
    keys+=("$(gpu_key "$g")")
  done
  dup=$(first_dup "${keys[@]}")
  [[ -z $dup ]] || usage_error "$opt: '$dup' is listed twice (one worker per GPU)"
}

# check_control VALUE: HOST:PORT that workers can dial, the host part into CONTROL_HOST. The port
# is 1-65535 (the coordinator would take 0, any free port, but the workers could not find it); an
# IPv6 host goes in brackets, as the coordinator splits at the last colon.
check_control() {
  local re='^(\[[0-9A-Fa-f:.]+\]|[^]:[]+):([1-9][0-9]{0,4})$'
  if [[ ! $1 =~ $re ]] || ((BASH_REMATCH[2] > 65535)); then
    usage_error "--control: '$1' is not HOST:PORT (port 1-65535, an IPv6 address in brackets)"
  fi
  # shellcheck disable=SC2034 # for the sourcing script
  CONTROL_HOST=${BASH_REMATCH[1]}
}

# check_coord_args ARG...: none of the coordinator's arguments may set what the launcher sets.
# strata-coordinator parses with getopt_long, which takes any unambiguous prefix of an option
# (--stage 2, --rep=1), so every prefix of a reserved name is refused, however short: a short one
# names other options too and the coordinator would refuse it as ambiguous anyway, and whether it
# is ambiguous depends on the coordinator's option table, which may change.
check_coord_args() {
  local a name r
  for a in "$@"; do
    [[ $a == --?* ]] || continue
    name=${a#--}
    name=${name%%=*}
    [[ -n $name ]] || continue
    for r in secret-file control replicas stages control-tls-cert control-tls-key; do
      [[ $r == "$name"* ]] || continue
      [[ $r == "$name" ]] && usage_error "$a after --: the launcher sets it (use its own option)"
      usage_error "$a after --: it abbreviates --$r, which the launcher sets (use its own option)"
    done
  done
}

# check_control_tls CERT KEY CA: the launchers' --control-tls-* options. Cert and key go
# together (the coordinator then checks that they belong together); CA needs them. Sets TLS_CA to
# the file the workers check the coordinator with (CA, else the certificate itself) or ''.
check_control_tls() {
  local cert=$1 key=$2 ca=$3 f
  [[ -z $cert && -z $key ]] || [[ -n $cert && -n $key ]] ||
    usage_error "--control-tls-cert and --control-tls-key go together"
  [[ -z $ca || -n $cert ]] || usage_error "--control-tls-ca needs --control-tls-cert"
  for f in "--control-tls-cert:$cert" "--control-tls-key:$key" "--control-tls-ca:$ca"; do
    [[ -z ${f#*:} || (-f ${f#*:} && -r ${f#*:}) ]] || usage_error "${f%%:*} ${f#*:}: not a readable file"
  done
  # shellcheck disable=SC2034 # for the sourcing script
  TLS_CA=${ca:-$cert}
}

# shq WORD...: the words as one line for a POSIX shell (plain words as they are, others in
# single quotes), used both to print commands and to build the command strings ssh runs remotely.
shq() {
  local w out='' q="'\\''"
  for w in "$@"; do
    if [[ $w =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then out+=" $w"; else out+=" '${w//\'/$q}'"; fi
  done
  printf '%s' "${out# }"
}

print_cmd() { printf '%s\n' "$(shq "$@")"; }

# find_bin NAME DIR: the path of NAME in DIR, or in PATH when DIR is empty. A dry run only
# prints, so it accepts a missing binary (and prints the bare name); a real run refuses it.
find_bin() {
  local name=$1 dir=$2 dry=$3 path
  if [[ -n $dir ]]; then
    path=$dir/$name
    [[ -x $path || $dry == 1 ]] || usage_error "--bin-dir $dir: no executable $name there"
  else
    path=$(command -v "$name" || true)
    if [[ -z $path ]]; then
      [[ $dry == 1 ]] || usage_error "$name is not in PATH (build it, install it or use --bin-dir)"
      path=$name
    fi
  fi
  printf '%s\n' "$path"
}

# make_secret DIR: 32 random bytes as 64 hex characters in DIR/cluster.secret, mode 0600. DIR
# comes from mktemp -d (0700), so no other user can read or replace the file.
make_secret() {
  local file=$1/cluster.secret hex
  hex=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')
  (umask 077 && printf '%s\n' "$hex" >"$file")
  chmod 600 "$file"
  printf '%s\n' "$file"
}

# check_secret FILE: readable and of a size the binaries accept: 16-256 bytes once trailing CR and
# LF bytes are dropped (proto/credential_file.c drops all of them), in a file of at most 4095 bytes
# (strata-coordinator reads no more); a file other users can read is only warned about (their
# choice).
check_secret() {
  local file=$1 size hex mode
  [[ -f $file && -r $file ]] || usage_error "--secret-file $file: not a readable file"
  size=$(wc -c <"$file")
  ((size <= 4095)) || usage_error "--secret-file $file: the secret must be 16 to 256 bytes; the file has $size"
  # As hex, since a shell variable cannot hold a NUL byte; the string has two digits a byte, so a
  # suffix of two is always the last byte.
  hex=$(od -An -v -tx1 "$file" | tr -d ' \n')
  while [[ $hex == *0a || $hex == *0d ]]; do hex=${hex%??}; done
  size=$((${#hex} / 2))
  ((size >= 16 && size <= 256)) ||
    usage_error "--secret-file $file: the secret must be 16 to 256 bytes (trailing newlines aside); it has $size"
  mode=$(stat -c %a "$file")
  [[ $mode =~ [0-7]00$ ]] || log "warning: $file has mode $mode; 0600 keeps the cluster secret private"
}

# launcher_alive: the launcher still runs. In its background subshells $$ is still the launcher's
# pid; once it is gone (SIGKILL: no trap ran) nobody would ever stop a restarted worker.
# The supervisor's parent is asked rather than kill -0 $$, which a killed launcher its own parent
# has not reaped yet (a zombie), or a new process given its pid, would still answer.
launcher_alive() {
  local stat ppid
  if ! stat=$(</proc/$BASHPID/stat) 2>/dev/null; then
    kill -0 "$$" 2>/dev/null
    return
  fi
  stat=${stat##*) } # the name in parentheses may hold spaces
  read -r _ ppid _ <<<"$stat"
  [[ $ppid == "$$" ]]
}

# supervise LABEL CMD...: runs CMD again whenever it exits (the worker exits when its coordinator
# link breaks and must rejoin), waiting RESTART_DELAY seconds, doubled after each run shorter than
# a minute, at most MAX_RESTART_DELAY. Exit status 2 (bad usage) is not retried: the same
# arguments would fail again; nor is anything once the launcher is gone. SIGUSR1: no more
# restarts; SIGTERM: stop the worker and return. Runs in a background subshell of its own.
supervise() {
  local label=$1
  shift
  local delay=$RESTART_DELAY rc started t
  restart=1 interrupted=0 child=''
  trap 'restart=0 interrupted=1' USR1
  trap 'restart=0 interrupted=1; [[ -z $child ]] || kill -TERM "$child" 2>/dev/null || true' TERM
  # The launcher decides when workers stop (after the coordinator's drain), on a hangup too.
  trap '' INT HUP
  while ((restart)); do
    started=$SECONDS
    "$@" &
    child=$!
    # A trapped signal ends `wait` early (status > 128) while the worker may still run.
    while :; do
      interrupted=0 rc=0
      wait "$child" || rc=$?
      ((interrupted)) && kill -0 "$child" 2>/dev/null && continue
      break
    done
    child=''
    ((restart)) || break
    if ((rc == 2)); then
      log "$label: bad usage (exit 2): not restarting it"
      return 2
    fi
    # 126/127: the command (a remote strata-worker, through env) cannot be run or was not found;
    # no restart will find it.
    if ((rc == 126 || rc == 127)); then
      log "$label: exit $rc: its program could not be run or was not found: not restarting it"
      return 2
    fi
    if ! launcher_alive; then
      log "$label exited with status $rc; the launcher is gone: not restarting it"
      return 0
    fi
    ((SECONDS - started < 60)) || delay=$RESTART_DELAY
    log "$label exited with status $rc; restarting it in ${delay}s"
    # Half-second steps, so that a launcher killed meanwhile is noticed before the restart.
    for ((t = 0; t < delay * 2 && restart; t++)); do
      sleep 0.5 &
      child=$!
      wait "$child" || true
      child=''
      launcher_alive || break
    done
    ((restart)) || break
    if ! launcher_alive; then
      log "$label: the launcher is gone: not restarting it"
      return 0
    fi
    delay=$((delay * 2 > MAX_RESTART_DELAY ? MAX_RESTART_DELAY : delay * 2))
  done
  return 0
}

# on_stop: the first SIGTERM/SIGINT/SIGHUP drains (the coordinator finishes or ends its requests,
# then exits; workers are not restarted meanwhile). A second one is passed on: the coordinator
# ends its drain at once (what still runs ends with UNAVAILABLE) and still shuts down its workers
# and removes its secret. A third kills it, for a coordinator that no longer answers. Once the
# coordinator has exited, signals change nothing: the workers are being stopped already.
on_stop() {
  if ((coord_done)); then
    log "signal: the coordinator has exited; still stopping the workers"
    return 0
  fi
  stopping=$((stopping + 1))
  if ((stopping == 1)); then
    log "stopping: draining the coordinator, then stopping the workers"
    local p
    for p in "${sup_pids[@]}"; do kill -USR1 "$p" 2>/dev/null || true; done
    kill -TERM "$coord_pid" 2>/dev/null || true
  elif ((stopping == 2)); then
    log "second signal: the coordinator ends its drain now (a third kills it)"
    kill -TERM "$coord_pid" 2>/dev/null || true
  else
    log "third signal: killing the coordinator"
    kill -KILL "$coord_pid" 2>/dev/null || true
  fi
  return 0 # a bare return would give the interrupted wait's status, and set -e would exit
}

# run_cluster: starts the coordinator and one supervised worker per index, waits until the
# coordinator exits, then stops the workers. Returns the coordinator's exit status (2 when a
# worker was refused for bad usage or its program could not be run: exit 126 or 127).
run_cluster() {
  local k p rc=0 worker_failed=0
  stopping=0 coord_done=0 sup_pids=()
  # Job control puts every child in its own process group: a Ctrl-C on the terminal reaches only
  # this script, which then stops the processes in the right order.
  set -m
  "${COORD_CMD[@]}" &
  coord_pid=$!
  # A hangup (terminal closed, ssh lost) drains too: its default action would kill only this
  # script, whose EXIT trap removes the secret, and leave the coordinator and workers orphaned.
  trap on_stop TERM INT HUP
  for ((k = 0; k < N_WORKERS; k++)); do
    worker_command "$k"
    supervise "worker $k" "${WCMD[@]}" &
    sup_pids+=($!)
  done
  log "coordinator pid $coord_pid, $N_WORKERS supervised workers; SIGTERM, SIGHUP or Ctrl-C drains and stops"
  while kill -0 "$coord_pid" 2>/dev/null; do
    if ((!stopping)); then
      for p in "${sup_pids[@]}"; do
        kill -0 "$p" 2>/dev/null && continue
        log "a worker was refused for bad usage or its program could not be run: stopping"
        worker_failed=1
        on_stop
        break
      done
    fi
    sleep 0.5 & # polling keeps this portable to bash 4 (no wait -p) and signals prompt
    wait $! || true
  done
  wait "$coord_pid" || rc=$?
  coord_done=1
  log "coordinator exited with status $rc; stopping the workers"
  for p in "${sup_pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  # A trapped signal ends `wait` early while the supervisor may still be stopping its worker.
  for p in "${sup_pids[@]}"; do
    while kill -0 "$p" 2>/dev/null; do wait "$p" || true; done
  done
  trap - TERM INT HUP
  ((worker_failed)) && return 2
  return "$rc"
}
