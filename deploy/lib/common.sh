# shellcheck shell=bash
# Shared by deploy/launch-node.sh and deploy/launch-multinode.sh (sourced, never run): argument
# helpers, the cluster secret, and the supervision of one coordinator plus its workers.
#
# The sourcing script sets PROG (its name, for messages), RESTART_DELAY and MAX_RESTART_DELAY
# (seconds), COORD_CMD (an array: the coordinator's command line) and N_WORKERS, and defines
# worker_command K, which fills the array WCMD with worker K's command line (an environment
# prefix goes through `env`, so the same array can be printed and run).

log() { printf '%s: %s\n' "$PROG" "$*" >&2; }

# Bad usage: a message and exit 2, like the strata binaries.
usage_error() {
  printf '%s: %s (try --help)\n' "$PROG" "$*" >&2
  exit 2
}

# need_value OPTION ARGC: an option that takes a value must have one.
need_value() { (($2 >= 2)) || usage_error "$1 needs a value"; }

# A decimal number without leading zeros (bash reads 08 as bad octal), at most 9 digits.
is_uint() { [[ $1 =~ ^(0|[1-9][0-9]{0,8})$ ]]; }
is_pos() { [[ $1 =~ ^[1-9][0-9]{0,8}$ ]]; }

# The checks both launchers make of the options they share: --stages ($1) and the restart delays.
check_shared_options() {
  is_pos "$1" || usage_error "--stages: '$1' is not a positive integer"
  is_uint "$RESTART_DELAY" || usage_error "--restart-delay: '$RESTART_DELAY' is not a whole number of seconds"
  is_uint "$MAX_RESTART_DELAY" || usage_error "--max-restart-delay: '$MAX_RESTART_DELAY' is not a whole number of seconds"
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

# check_secret FILE: readable and of a size the binaries accept (16-256 bytes, a trailing
# newline allowed); a file other users can read is only warned about (their choice).
check_secret() {
  local file=$1 size mode
  [[ -f $file && -r $file ]] || usage_error "--secret-file $file: not a readable file"
  size=$(wc -c <"$file")
  ((size >= 16 && size <= 258)) || usage_error "--secret-file $file: the secret must be 16 to 256 bytes"
  mode=$(stat -c %a "$file")
  [[ $mode =~ [0-7]00$ ]] || log "warning: $file has mode $mode; 0600 keeps the cluster secret private"
}

# supervise LABEL CMD...: runs CMD again whenever it exits (the worker exits when its coordinator
# link breaks and must rejoin), waiting RESTART_DELAY seconds, doubled after each run shorter than
# a minute, at most MAX_RESTART_DELAY. Exit status 2 (bad usage) is not retried: the same
# arguments would fail again. SIGUSR1: no more restarts; SIGTERM: stop the worker and return.
# Runs in a background subshell of its own.
supervise() {
  local label=$1
  shift
  local delay=$RESTART_DELAY rc started
  restart=1 interrupted=0 child=''
  trap 'restart=0 interrupted=1' USR1
  trap 'restart=0 interrupted=1; [[ -z $child ]] || kill -TERM "$child" 2>/dev/null || true' TERM
  trap '' INT # the launcher decides when workers stop (after the coordinator's drain)
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
    ((SECONDS - started < 60)) || delay=$RESTART_DELAY
    log "$label exited with status $rc; restarting it in ${delay}s"
    sleep "$delay" &
    child=$!
    wait "$child" || true
    child=''
    delay=$((delay * 2 > MAX_RESTART_DELAY ? MAX_RESTART_DELAY : delay * 2))
  done
  return 0
}

# on_stop: the first SIGTERM/SIGINT drains (the coordinator finishes or ends its requests, then
# exits; workers are not restarted meanwhile); a second one kills the coordinator.
on_stop() {
  if ((stopping)); then
    log "second signal: killing the coordinator"
    kill -KILL "$coord_pid" 2>/dev/null || true
    return 0 # a bare return would give the interrupted wait's status, and set -e would exit
  fi
  stopping=1
  log "stopping: draining the coordinator, then stopping the workers"
  local p
  for p in "${sup_pids[@]}"; do kill -USR1 "$p" 2>/dev/null || true; done
  kill -TERM "$coord_pid" 2>/dev/null || true
}

# run_cluster: starts the coordinator and one supervised worker per index, waits until the
# coordinator exits, then stops the workers. Returns the coordinator's exit status (2 when a
# worker was refused for bad usage).
run_cluster() {
  local k p rc=0 worker_failed=0
  stopping=0 sup_pids=()
  # Job control puts every child in its own process group: a Ctrl-C on the terminal reaches only
  # this script, which then stops the processes in the right order.
  set -m
  "${COORD_CMD[@]}" &
  coord_pid=$!
  trap on_stop TERM INT
  for ((k = 0; k < N_WORKERS; k++)); do
    worker_command "$k"
    supervise "worker $k" "${WCMD[@]}" &
    sup_pids+=($!)
  done
  log "coordinator pid $coord_pid, $N_WORKERS supervised workers; SIGTERM or Ctrl-C drains and stops"
  while kill -0 "$coord_pid" 2>/dev/null; do
    if ((!stopping)); then
      for p in "${sup_pids[@]}"; do
        kill -0 "$p" 2>/dev/null && continue
        log "a worker was refused for bad usage: stopping"
        worker_failed=1
        on_stop
        break
      done
    fi
    sleep 0.5 & # polling keeps this portable to bash 4 (no wait -p) and signals prompt
    wait $! || true
  done
  wait "$coord_pid" || rc=$?
  log "coordinator exited with status $rc; stopping the workers"
  for p in "${sup_pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${sup_pids[@]}"; do wait "$p" || true; done
  trap - TERM INT
  ((worker_failed)) && return 2
  return "$rc"
}
