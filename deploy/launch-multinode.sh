#!/usr/bin/env bash
# Several nodes: strata-coordinator on this host, strata-worker processes on remote hosts over
# ssh (one per GPU), the cluster secret copied to each host first (mode 0600, over ssh's stdin so
# it never appears on a command line). deploy/README.md explains the layout; --help lists every
# option.
set -euo pipefail
PROG=launch-multinode.sh
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=lib/common.sh
source "$here/lib/common.sh"

usage() {
  cat <<'EOF'
usage: launch-multinode.sh --control HOST:PORT (--hosts H1,H2 --gpus-per-host N |
                           --host H:GPUS ...) [options] [-- COORDINATOR-ARGS...]

Starts strata-coordinator on this host and strata-worker processes on other hosts over ssh,
one per GPU, each pinned with CUDA_VISIBLE_DEVICES. A worker that exits (its ssh session ends)
is started again with backoff. SIGTERM, SIGHUP or Ctrl-C drains the coordinator, then stops the
local ssh sessions; remote workers exit by themselves when the coordinator ends their link. A
second signal ends the coordinator's drain at once, a third kills it. Exits with the
coordinator's status.

Hosts (ssh destinations [user@]host; the host part is also each worker's data-plane address, so
use names or addresses that the other hosts reach on the private network; no IPv6 literals;
each host once, whatever the user). Names in --hosts, --host and --control are resolved on this
host and passed on as addresses (a host's own name often maps to 127.0.1.1 there); one that
resolves to loopback here is refused, one that does not resolve is passed on as it is:
  --hosts LIST              comma-separated hosts, each with --gpus-per-host or
                            --cpu-workers-per-host workers
  --gpus-per-host N         workers on GPUs 0..N-1 of every --hosts host
  --cpu-workers-per-host N  N workers without a GPU on every --hosts host instead
  --host HOST:GPUS          one host with its own GPU list, e.g. gpu7:0,1,3, each GPU once
                            (repeatable; may be combined with --hosts)

Cluster:
  --control HOST:PORT       required: the address of THIS host on the private network where the
                            coordinator takes workers (never a public address; loopback and
                            wildcard addresses are refused; port 1-65535, an IPv6 address in
                            brackets)
  --control-tls-cert FILE   TLS on the control port: certificate (PEM) naming the address the
                            workers dial (the --control host as resolved here, which --dry-run
                            shows: an IP subjectAltName), with --control-tls-key
  --control-tls-key FILE    its private key (PEM)
  --control-tls-ca FILE     the CA the workers check that certificate with, copied to each host
                            (default: the certificate itself, as when self-signed)
  --remote-ca PATH          where that CA is written on each host (default
                            .strata/control-ca.pem, relative to the remote home)
  --data-port PORT          first data-plane port on each host (default 50060); worker K of a
                            host listens on PORT+K; workers must reach each other there
  --stages N                pipeline stages per replica (default 1); the workers form
                            workers/N replicas (the coordinator assigns the stages)
  --secret-file FILE        the cluster secret (16-256 bytes, mode 0600); default: 32 random
                            bytes in a private temporary directory, removed at exit (the copies
                            on the hosts too)
  --remote-secret PATH      where the secret is written on each host (default
                            .strata/cluster.secret, relative to the remote home; its directory
                            is created 0700)
  --bin-dir DIR             where strata-coordinator is on this host (default: PATH)
  --remote-bin-dir DIR      where strata-worker is on the hosts (default: the remote PATH)
  --nvme-dir DIR            NVMe spill root on the hosts: worker K spills to DIR/worker-K
  --worker-arg ARG          one more argument for every worker (repeatable)
  --ssh-option OPT          an ssh -o option, e.g. --ssh-option Port=2222 (repeatable); ssh
                            always runs with BatchMode=yes (keys, no password prompts) and,
                            unless given here, ConnectTimeout=10

Supervision:
  --restart-delay S         seconds before restarting a worker (default 1, at least 1), doubled
                            after each run shorter than a minute
  --max-restart-delay S     the most it waits between restarts (default 30, at least
                            --restart-delay)

  --dry-run                 print the commands it would run, start nothing, exit 0
  -h, --help                this help

Arguments after -- go to strata-coordinator unchanged (e.g. --model PATH, which must be the same
path on every host, --listen, --metrics, --kv, --config, --tls-cert/--tls-key, --token-file);
the launcher sets --secret-file, --control, --replicas, --stages and --control-tls-cert/-key
itself and refuses them after -- (abbreviated too, as --stage). Options take their value as the next argument. Exit status:
the coordinator's, 2 for bad usage.

A GPU worker computes on the one GPU it sees (--device cuda:0), a CPU worker on host cores. The
worker program has not yet run on a GPU, nor NCCL between two GPU workers (docs/gpu.md).
EOF
}

control='' data_port=50060 stages=1 secret_file='' remote_secret=.strata/cluster.secret bin_dir=''
remote_bin_dir='' nvme_dir='' gpus_per_host='' cpu_per_host='' dry_run=0
tls_cert='' tls_key='' tls_ca='' remote_ca=.strata/control-ca.pem
RESTART_DELAY=1 MAX_RESTART_DELAY=30
host_list=() host_specs=() worker_args=() ssh_opts=(-o BatchMode=yes) coord_args=()
while (($#)); do
  case $1 in
    --hosts) need_value "$1" $#; split_list --hosts "$2"; host_list+=("${LIST[@]}"); shift ;;
    --gpus-per-host) need_value "$1" $#; gpus_per_host=$2; shift ;;
    --cpu-workers-per-host) need_value "$1" $#; cpu_per_host=$2; shift ;;
    --host) need_value "$1" $#; host_specs+=("$2"); shift ;;
    --control) need_value "$1" $#; control=$2; shift ;;
    --data-port) need_value "$1" $#; data_port=$2; shift ;;
    --stages) need_value "$1" $#; stages=$2; shift ;;
    --secret-file) need_value "$1" $#; secret_file=$2; shift ;;
    --remote-secret) need_value "$1" $#; remote_secret=$2; shift ;;
    --control-tls-cert) need_value "$1" $#; tls_cert=$2; shift ;;
    --control-tls-key) need_value "$1" $#; tls_key=$2; shift ;;
    --control-tls-ca) need_value "$1" $#; tls_ca=$2; shift ;;
    --remote-ca) need_value "$1" $#; remote_ca=$2; shift ;;
    --bin-dir) need_value "$1" $#; bin_dir=$2; shift ;;
    --remote-bin-dir) need_value "$1" $#; remote_bin_dir=$2; shift ;;
    --nvme-dir) need_value "$1" $#; nvme_dir=$2; shift ;;
    --worker-arg) need_value "$1" $#; worker_args+=("$2"); shift ;;
    --ssh-option) need_value "$1" $#; ssh_opts+=(-o "$2"); shift ;;
    --restart-delay) need_value "$1" $#; RESTART_DELAY=$2; shift ;;
    --max-restart-delay) need_value "$1" $#; MAX_RESTART_DELAY=$2; shift ;;
    --dry-run) dry_run=1 ;;
    -h | --help) usage; exit 0 ;;
    --) shift; coord_args=("$@"); break ;;
    *) usage_error "unknown option '$1'" ;;
  esac
  shift
done

# Without a connect timeout an unreachable host hangs the secret copy for minutes, silently.
[[ ${ssh_opts[*],,} == *connecttimeout* ]] || ssh_opts+=(-o ConnectTimeout=10)

check_shared_options "$stages"
if ! is_pos "$data_port" || ((data_port > 65535)); then usage_error "--data-port: '$data_port' is not a port"; fi
[[ -n $control ]] || usage_error "--control HOST:PORT is required (this host's private-network address)"
check_control "$control"
# Host names are case-insensitive; ::ffff:127.x.y.z is IPv4 loopback mapped into IPv6.
case ${CONTROL_HOST,,} in
  localhost | localhost. | *.localhost | *.localhost. | localhost.localdomain | ip6-localhost | ip6-loopback | \
    127.* | '[::1]' | '[0:0:0:0:0:0:0:1]' | '[::ffff:127.'* | '[::ffff:7f'* | '[0:0:0:0:0:ffff:127.'* | \
    0 | 0.0.0.0 | '[::]' | '[0:0:0:0:0:0:0:0]' | '[::ffff:0.0.0.0]' | '*')
    usage_error "--control $control: remote workers need this host's private-network address" ;;
esac
[[ $remote_secret == ?* && $remote_secret != */ ]] || usage_error "--remote-secret: '$remote_secret' is not a file path"
[[ $remote_ca == ?* && $remote_ca != */ ]] || usage_error "--remote-ca: '$remote_ca' is not a file path"
[[ $remote_ca != "$remote_secret" ]] || usage_error "--remote-ca: '$remote_ca' is where the secret goes"
check_control_tls "$tls_cert" "$tls_key" "$tls_ca"
# Remote paths reach the remote shell quoted, so a ~ would name a folder called ~.
for opt in "--remote-secret:$remote_secret" "--remote-ca:$remote_ca" "--remote-bin-dir:$remote_bin_dir" "--nvme-dir:$nvme_dir"; do
  [[ ${opt#*:} != '~'* ]] ||
    usage_error "${opt%%:*}: '${opt#*:}': ~ is not expanded on the hosts; give an absolute path or one relative to the remote home (without ~/)"
done

# Names become addresses here, where they resolve as the other hosts see them: Debian and Ubuntu
# map a machine's own name to 127.0.1.1 in /etc/hosts, so a worker (or this coordinator) that
# resolved its own name would listen on loopback, and its neighbours' connections were refused.
# A name this host cannot resolve is passed on unchanged (each host resolves it then).
resolve_v4() { getent ahostsv4 "$1" 2>/dev/null | awk 'NR == 1 { print $1 }' || true; }
declare -A addr_of=()
address_of() { # NAME OPTION: sets addr_of[NAME]
  local a
  [[ -z ${addr_of[$1]+set} ]] || return 0
  a=$(resolve_v4 "$1")
  [[ $a != 127.* ]] ||
    usage_error "$2: '$1' resolves to $a (loopback) on this host (/etc/hosts?): give its private-network address"
  addr_of[$1]=${a:-$1}
}
if [[ $CONTROL_HOST != '['* ]]; then
  address_of "$CONTROL_HOST" --control
  control=${addr_of[$CONTROL_HOST]}:${control##*:}
fi
check_coord_args "${coord_args[@]}"

# Every worker as parallel arrays: its ssh destination, its device ('' for CPU) and its index on
# that host (the data port offset and the spill subdirectory).
w_dest=() w_dev=() w_slot=() dests=()
add_host() { # DEST DEVICE...
  local dest=$1 slot=0 d
  shift
  [[ $dest =~ ^([A-Za-z0-9._-]+@)?[A-Za-z0-9._-]+$ ]] || usage_error "'$dest' is not an ssh destination [user@]host"
  for d in "$@"; do
    w_dest+=("$dest") w_dev+=("$d") w_slot+=("$slot")
    slot=$((slot + 1))
  done
  ((slot + data_port < 65536)) || usage_error "$dest: data ports from $data_port overflow"
  dests+=("$dest")
}
if ((${#host_list[@]})); then
  [[ -z $gpus_per_host || -z $cpu_per_host ]] || usage_error "--gpus-per-host and --cpu-workers-per-host exclude each other"
  n=${gpus_per_host:-$cpu_per_host}
  [[ -n $n ]] || usage_error "--hosts needs --gpus-per-host N or --cpu-workers-per-host N"
  is_pos "$n" || usage_error "'$n' is not a positive number of workers per host"
  devs=()
  for ((k = 0; k < n; k++)); do
    if [[ -n $gpus_per_host ]]; then devs+=("$k"); else devs+=(''); fi
  done
  for h in "${host_list[@]}"; do add_host "$h" "${devs[@]}"; done
elif [[ -n $gpus_per_host || -n $cpu_per_host ]]; then
  usage_error "--gpus-per-host and --cpu-workers-per-host apply to --hosts"
fi
for spec in "${host_specs[@]}"; do
  [[ $spec == *:?* ]] || usage_error "--host '$spec' is not HOST:GPUS (e.g. gpu7:0,1)"
  split_list "--host $spec" "${spec#*:}"
  check_gpus "--host $spec" "${LIST[@]}"
  add_host "${spec%%:*}" "${LIST[@]}"
done
N_WORKERS=${#w_dest[@]}
((N_WORKERS)) || usage_error "no workers: give --hosts with --gpus-per-host, or --host HOST:GPUS"
# By host, not destination: u@gpu1 and v@gpu1 are one machine, where both workers would get the
# same --name and --data port.
dest_hosts=()
for d in "${dests[@]}"; do dest_hosts+=("${d#*@}"); done
dup=$(first_dup "${dest_hosts[@],,}")
[[ -z $dup ]] || usage_error "host $dup is listed twice (give all its GPUs in one --host)"
for h in "${dest_hosts[@]}"; do address_of "$h" "host"; done
((N_WORKERS % stages == 0)) || usage_error "$N_WORKERS workers do not split into replicas of $stages stages"

coord_bin=$(find_bin strata-coordinator "$bin_dir" "$dry_run")
worker_bin=${remote_bin_dir:+$remote_bin_dir/}strata-worker
generated=0
if [[ -n $secret_file ]]; then
  check_secret "$secret_file"
elif ((dry_run)); then
  secret_file=${TMPDIR:-/tmp}/strata-secret.XXXXXX/cluster.secret
  echo "# would write 32 random bytes (hex, mode 0600) into a new private directory (mktemp -d)"
else
  secret_dir=$(mktemp -d "${TMPDIR:-/tmp}/strata-secret.XXXXXX")
  trap 'rm -rf "$secret_dir"' EXIT
  secret_file=$(make_secret "$secret_dir")
  generated=1
fi

# Remote commands are strings for the remote shell: every word goes through shq.
secret_parent=$(dirname -- "$remote_secret")
# A fresh file under umask 077, then renamed over the old one: the secret is never readable by
# others, not even for a moment, whatever mode an old copy had.
copy_cmd="umask 077 && mkdir -p -- $(shq "$secret_parent") && cat > $(shq "$remote_secret.tmp") && chmod 600 -- $(shq "$remote_secret.tmp") && mv -f -- $(shq "$remote_secret.tmp" "$remote_secret")"
[[ -z $nvme_dir ]] || copy_cmd+=" && mkdir -p -- $(shq "$nvme_dir")"
# The CA is no secret, but replaced the same way: a worker never reads half a file.
ca_copy_cmd="mkdir -p -- $(shq "$(dirname -- "$remote_ca")") && cat > $(shq "$remote_ca.tmp") && mv -f -- $(shq "$remote_ca.tmp" "$remote_ca")"

COORD_CMD=("$coord_bin" --secret-file "$secret_file" --control "$control"
  --replicas "$((N_WORKERS / stages))" --stages "$stages")
[[ -z $tls_cert ]] || COORD_CMD+=(--control-tls-cert "$tls_cert" --control-tls-key "$tls_key")
COORD_CMD+=("${coord_args[@]}")
worker_command() {
  local k=$1 dest=${w_dest[$1]} slot=${w_slot[$1]} host remote
  host=${dest#*@}
  remote=(exec env "CUDA_VISIBLE_DEVICES=${w_dev[k]}" "$worker_bin" --coordinator "$control"
    --secret-file "$remote_secret" --name "$host-w$slot" --data "${addr_of[$host]}:$((data_port + slot))")
  # A GPU worker computes on the one device it sees (its index there is 0); a CPU worker sees none.
  [[ -z ${w_dev[k]} ]] || remote+=(--device cuda:0)
  [[ -z $nvme_dir ]] || remote+=(--nvme-dir "$nvme_dir/worker-$slot")
  [[ -z $TLS_CA ]] || remote+=(--coordinator-ca "$remote_ca")
  remote+=("${worker_args[@]}")
  WCMD=(ssh -n "${ssh_opts[@]}" "$dest" "$(shq "${remote[@]}")")
}

if ((dry_run)); then
  for d in "${dests[@]}"; do
    printf '%s < %s\n' "$(shq ssh "${ssh_opts[@]}" "$d" "$copy_cmd")" "$(shq "$secret_file")"
    [[ -z $TLS_CA ]] || printf '%s < %s\n' "$(shq ssh "${ssh_opts[@]}" "$d" "$ca_copy_cmd")" "$(shq "$TLS_CA")"
  done
  print_cmd "${COORD_CMD[@]}"
  for ((k = 0; k < N_WORKERS; k++)); do
    worker_command "$k"
    print_cmd "${WCMD[@]}"
  done
  echo "# each worker restarts when its ssh session ends (after ${RESTART_DELAY}s, doubling up to ${MAX_RESTART_DELAY}s)"
  exit 0
fi

copied=()
if ((generated)); then
  # The copies go with the generated secret: nothing stays behind that could join a later cluster.
  # Set before the first copy, so that a copy failing on one host removes those already made.
  # shellcheck disable=SC2317 # called from the EXIT trap
  cleanup_remote() {
    local d
    for d in "${copied[@]}"; do
      # shellcheck disable=SC2029 # the paths are quoted for the remote shell by shq
      ssh "${ssh_opts[@]}" "$d" "rm -f -- $(shq "$remote_secret" "$remote_secret.tmp")" </dev/null || true
    done
    rm -rf "$secret_dir"
  }
  trap cleanup_remote EXIT
fi
for d in "${dests[@]}"; do
  # Counted before the copy: a copy that fails after the secret is in place (the spill folder's
  # mkdir, a dropped connection) still leaves it there to remove.
  copied+=("$d")
  # shellcheck disable=SC2029 # copy_cmd is built for the remote shell, its words quoted by shq
  ssh "${ssh_opts[@]}" "$d" "$copy_cmd" <"$secret_file" || {
    log "$d: could not copy the cluster secret over ssh"
    exit 1
  }
  if [[ -n $TLS_CA ]]; then
    # shellcheck disable=SC2029 # ca_copy_cmd is built for the remote shell, its words quoted by shq
    ssh "${ssh_opts[@]}" "$d" "$ca_copy_cmd" <"$TLS_CA" || {
      log "$d: could not copy the control port's CA over ssh"
      exit 1
    }
  fi
done
rc=0
run_cluster || rc=$?
exit "$rc"
