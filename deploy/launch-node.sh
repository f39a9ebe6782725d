#!/usr/bin/env bash
# One node: strata-coordinator plus one strata-worker per GPU (or N CPU workers), each worker
# restarted when it exits, SIGTERM/SIGINT/SIGHUP drains the coordinator before the workers stop.
# deploy/README.md explains the layout; --help lists every option.
set -euo pipefail
PROG=launch-node.sh
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=lib/common.sh
source "$here/lib/common.sh"

usage() {
  cat <<'EOF'
usage: launch-node.sh [options] [-- COORDINATOR-ARGS...]

Starts strata-coordinator and one strata-worker per GPU on this machine, supervises the workers
(restarted with backoff whenever they exit) and, on SIGTERM, SIGHUP or Ctrl-C, drains the
coordinator first and stops the workers after it (a second signal ends the drain at once, a
third kills the coordinator). Exits with the coordinator's status.

Workers:
  --gpus LIST            comma-separated GPU indexes or UUIDs, one worker each, pinned with
                         CUDA_VISIBLE_DEVICES, each at most once (default: every GPU that
                         `nvidia-smi -L` lists; MIG instances must be given here by UUID)
  --cpu-workers N        N workers without a GPU (CUDA_VISIBLE_DEVICES empty) instead
  --stages N             pipeline stages per replica (default 1); the workers form
                         workers/N replicas, passed to the coordinator as --replicas/--stages
  --nvme-dir DIR         NVMe spill root: worker K spills to DIR/worker-K (created 0700)
  --worker-arg ARG       one more argument for every worker, e.g. --worker-arg
                         --host-kv-mib=4096 (repeatable)

Cluster:
  --control HOST:PORT    the coordinator's worker endpoint (default 127.0.0.1:50052; port
                         1-65535, an IPv6 address in brackets); without TLS keep it on
                         loopback or a private network
  --control-tls-cert FILE
                         TLS on the control port: certificate (PEM) naming the --control
                         host (an IP subjectAltName for an address), with --control-tls-key
  --control-tls-key FILE its private key (PEM)
  --control-tls-ca FILE  the CA the workers check that certificate with (default: the
                         certificate itself, as when self-signed)
  --secret-file FILE     the cluster secret (16-256 bytes, mode 0600); default: 32 random
                         bytes written to a private temporary directory, removed at exit
  --bin-dir DIR          where strata-coordinator and strata-worker are (default: PATH)

Supervision:
  --restart-delay S      seconds before restarting a worker that exited (default 1, at least
                         1), doubled after each run shorter than a minute
  --max-restart-delay S  the most it waits between restarts (default 30, at least
                         --restart-delay)

  --dry-run              print the commands it would run, start nothing, exit 0
  -h, --help             this help

Arguments after -- go to strata-coordinator unchanged (e.g. --model, --listen, --metrics,
--kv, --config, --tls-cert/--tls-key, --token-file, --drain-seconds); the launcher sets
--secret-file, --control, --replicas, --stages and --control-tls-cert/--control-tls-key itself
and refuses them after -- (abbreviated too, as --stage). Options take their value as the next argument. Exit status: the
coordinator's, 2 for bad usage.

A GPU worker computes on the one GPU it sees (--device cuda:0), a CPU worker on host cores. The
worker program has not yet run on a GPU, nor NCCL between two GPU workers (docs/gpu.md).
EOF
}

gpus='' cpu_workers='' stages=1 nvme_dir='' control=127.0.0.1:50052 secret_file='' bin_dir=''
tls_cert='' tls_key='' tls_ca=''
dry_run=0 RESTART_DELAY=1 MAX_RESTART_DELAY=30
worker_args=() coord_args=()
while (($#)); do
  case $1 in
    --gpus) need_value "$1" $#; gpus=$2; shift ;;
    --cpu-workers) need_value "$1" $#; cpu_workers=$2; shift ;;
    --stages) need_value "$1" $#; stages=$2; shift ;;
    --nvme-dir) need_value "$1" $#; nvme_dir=$2; shift ;;
    --worker-arg) need_value "$1" $#; worker_args+=("$2"); shift ;;
    --control) need_value "$1" $#; control=$2; shift ;;
    --secret-file) need_value "$1" $#; secret_file=$2; shift ;;
    --control-tls-cert) need_value "$1" $#; tls_cert=$2; shift ;;
    --control-tls-key) need_value "$1" $#; tls_key=$2; shift ;;
    --control-tls-ca) need_value "$1" $#; tls_ca=$2; shift ;;
    --bin-dir) need_value "$1" $#; bin_dir=$2; shift ;;
    --restart-delay) need_value "$1" $#; RESTART_DELAY=$2; shift ;;
    --max-restart-delay) need_value "$1" $#; MAX_RESTART_DELAY=$2; shift ;;
    --dry-run) dry_run=1 ;;
    -h | --help) usage; exit 0 ;;
    --) shift; coord_args=("$@"); break ;;
    *) usage_error "unknown option '$1'" ;;
  esac
  shift
done

check_shared_options "$stages"
check_control "$control"
check_control_tls "$tls_cert" "$tls_key" "$tls_ca"
check_coord_args "${coord_args[@]}"

# The devices: explicit list, CPU workers, or every GPU nvidia-smi reports ("GPU 0: ...").
devices=()
if [[ -n $gpus && -n $cpu_workers ]]; then
  usage_error "--gpus and --cpu-workers exclude each other"
elif [[ -n $cpu_workers ]]; then
  is_pos "$cpu_workers" || usage_error "--cpu-workers: '$cpu_workers' is not a positive integer"
  for ((k = 0; k < cpu_workers; k++)); do devices+=(''); done
elif [[ -n $gpus ]]; then
  split_list --gpus "$gpus"
  devices=("${LIST[@]}")
  check_gpus --gpus "${devices[@]}"
elif command -v nvidia-smi >/dev/null; then
  mapfile -t devices < <(nvidia-smi -L | sed -n 's/^GPU \([0-9][0-9]*\):.*/\1/p')
fi
((${#devices[@]})) || usage_error "no GPU found (nvidia-smi missing or lists none): use --gpus LIST or --cpu-workers N"
N_WORKERS=${#devices[@]}
((N_WORKERS % stages == 0)) || usage_error "$N_WORKERS workers do not split into replicas of $stages stages"
replicas=$((N_WORKERS / stages))

coord_bin=$(find_bin strata-coordinator "$bin_dir" "$dry_run")
worker_bin=$(find_bin strata-worker "$bin_dir" "$dry_run")
if [[ -n $secret_file ]]; then
  check_secret "$secret_file"
elif ((dry_run)); then
  secret_file=${TMPDIR:-/tmp}/strata-secret.XXXXXX/cluster.secret
  echo "# would write 32 random bytes (hex, mode 0600) into a new private directory (mktemp -d)"
else
  secret_dir=$(mktemp -d "${TMPDIR:-/tmp}/strata-secret.XXXXXX")
  trap 'rm -rf "$secret_dir"' EXIT
  secret_file=$(make_secret "$secret_dir")
fi

COORD_CMD=("$coord_bin" --secret-file "$secret_file" --control "$control"
  --replicas "$replicas" --stages "$stages")
[[ -z $tls_cert ]] || COORD_CMD+=(--control-tls-cert "$tls_cert" --control-tls-key "$tls_key")
COORD_CMD+=("${coord_args[@]}")
host=${HOSTNAME%%.*}
worker_command() {
  local k=$1
  WCMD=(env "CUDA_VISIBLE_DEVICES=${devices[k]}" "$worker_bin" --coordinator "$control"
    --secret-file "$secret_file" --name "${host:-node}-w$k")
  # A GPU worker computes on the one device it sees (its index there is 0).
  [[ -z ${devices[k]} ]] || WCMD+=(--device cuda:0)
  [[ -z $nvme_dir ]] || WCMD+=(--nvme-dir "$nvme_dir/worker-$k")
  [[ -z $TLS_CA ]] || WCMD+=(--coordinator-ca "$TLS_CA")
  WCMD+=("${worker_args[@]}")
}

if ((dry_run)); then
  print_cmd "${COORD_CMD[@]}"
  for ((k = 0; k < N_WORKERS; k++)); do
    worker_command "$k"
    print_cmd "${WCMD[@]}"
  done
  echo "# each worker restarts when it exits (after ${RESTART_DELAY}s, doubling up to ${MAX_RESTART_DELAY}s)"
  exit 0
fi

[[ -z $nvme_dir ]] || (umask 077 && mkdir -p -- "$nvme_dir")
rc=0
run_cluster || rc=$?
exit "$rc"
