#!/usr/bin/env bash
# Start the run: `python -m jaxrl_orch.train` once per process, detached (nohup), each with a
# log file of its own under REMOTE_DIR/logs/ on its host.
#
# Layout (see README.md): the trainer slice NAME runs the trainer group, one process per
# worker (process index = worker id, P = the slice's worker count); engine replica i runs on
# the single-host VM NAME-engine-i as process P+i. First the VMs' internal IPs are read with
# `tpu-vm describe`; then the engines start, then every trainer worker (--worker=all), each
# with the same flags: --gin_file, --workdir, the layout (Processes.trainer_processes = P,
# Processes.engine_replicas = R), --coordinator_address=<trainer worker 0>:PORT, its own
# --process_index and, when R > 0, --engine_addresses=http://<engine 0>:PORT,... (the replicas'
# HTTP API), --weight_source=<trainer worker 0>:WEIGHT_PORT (the only address replicas pull
# weights from) and --api_key_file=logs/engine.key: replicas bind their VM's address, which
# needs a key; a fresh random one is written (mode 600) on every host of the run, after the
# host's pid check, so a launch refused there leaves a running run's key alone.
# Arguments after `--` are passed to every process unchanged (for example --gin_param=...).
# Every process has REMOTE_DIR/user (setup.sh --with: the user's own modules) on its PYTHONPATH.
# Refuses to start on a host where the pid recorded by a previous launch is alive.
#
# --workdir: a gs:// URL whenever the run spans more than one host (all processes read and
# write it); only a single-host run without engine VMs may use a local path (relative to
# REMOTE_DIR), default runs/NAME.
set -euo pipefail
# shellcheck source=_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

ALLOWED_FLAGS="--project --zone --name --engine-replicas --remote-dir --gin-file --workdir \
--coordinator-port --engine-port --weight-port --trainer-hosts"
USAGE="usage: $(basename "$0") [--dry-run] --project P --zone Z --name NAME [--engine-replicas R]
  [--remote-dir DIR] [--gin-file configs/tpu_v5e_8.gin]... [--workdir gs://BUCKET/run|runs/x]
  [--coordinator-port 8476] [--engine-port 50051] [--weight-port 8477] [--trainer-hosts N]
  [-- extra train args]
--gin-file: repeatable, one file per concern (configs/model, slice, env, tune, algo).
--trainer-hosts: the slice's worker count if you know it; a real run checks it against the
  slice, a dry run (which resolves nothing) assumes it (default 1).
env: TPU_PROJECT TPU_ZONE TPU_NAME TPU_ENGINE_REPLICAS TPU_REMOTE_DIR TPU_GIN_FILE TPU_WORKDIR
  TPU_COORDINATOR_PORT TPU_ENGINE_PORT TPU_WEIGHT_PORT TPU_TRAINER_HOSTS"
parse_args "$@"
require_target
[[ -n "$GIN_FILE" ]] || die "gin file is empty: pass --gin-file configs/<name>.gin"
COORDINATOR_PORT="$(port_setting --coordinator-port TPU_COORDINATOR_PORT "$COORDINATOR_PORT")"
ENGINE_PORT="$(port_setting --engine-port TPU_ENGINE_PORT "$ENGINE_PORT")"
WEIGHT_PORT="$(port_setting --weight-port TPU_WEIGHT_PORT "$WEIGHT_PORT")"
if [[ -n "$TRAINER_HOSTS" ]]; then
  TRAINER_HOSTS="$(int_setting --trainer-hosts TPU_TRAINER_HOSTS "$TRAINER_HOSTS")"
  ((TRAINER_HOSTS >= 1)) || die "--trainer-hosts must be at least 1"
fi
R="$ENGINE_REPLICAS"
target_flags

# The internal IPs of a VM's workers, in worker order, one per line (dry run: placeholders).
vm_ips() {
  local vm="$1" placeholder="$2" out
  local cmd=(gcloud compute tpus tpu-vm describe "$vm" "${TARGET_FLAGS[@]}"
    "--flatten=networkEndpoints[]" "--format=value(networkEndpoints.ipAddress)")
  if [[ "$DRY_RUN" == 1 ]]; then
    run "${cmd[@]}"
    echo "$placeholder" >&3
    return
  fi
  out="$(run "${cmd[@]}")" ||
    die "could not describe TPU VM $vm (see gcloud's message above): did create.sh make it with this --name/--engine-replicas?"
  local ip n=0
  while read -r ip; do
    [[ -z "$ip" ]] && continue
    [[ "$ip" =~ ^[0-9A-Fa-f:.]+$ ]] || die "TPU VM $vm reported '$ip' where an internal IP was expected"
    echo "$ip" >&3
    n=$((n + 1))
  done <<<"$out"
  ((n > 0)) || die "TPU VM $vm has no network endpoints yet (is it READY? gcloud compute tpus tpu-vm describe $vm --project=$PROJECT --zone=$ZONE)"
}

ipfile="$(mktemp)"
trap 'rm -f "$ipfile"' EXIT
vm_ips "$NAME" TRAINER_W0_IP 3>"$ipfile"
mapfile -t trainer_ips <"$ipfile"
if [[ "$DRY_RUN" == 1 ]]; then
  P="${TRAINER_HOSTS:-1}"
  note "# dry run: addresses are placeholders and the slice is taken to have $P worker(s) (--trainer-hosts)"
else
  P="${#trainer_ips[@]}"
  [[ -z "$TRAINER_HOSTS" || "$TRAINER_HOSTS" == "$P" ]] ||
    die "--trainer-hosts $TRAINER_HOSTS does not match TPU VM $NAME, which has $P worker(s)"
fi
engine_addrs=()
joined_addrs=""
for ((i = 0; i < R; i++)); do
  vm="$(engine_name "$i")"
  vm_ips "$vm" "ENGINE_${i}_IP" 3>"$ipfile"
  mapfile -t ips <"$ipfile"
  ((${#ips[@]} == 1)) ||
    die "engine VM $vm has ${#ips[@]} workers: an engine replica must be a single-host TPU VM"
  engine_addrs+=("http://${ips[0]}:$ENGINE_PORT")
done

if ((P > 1 || R > 0)); then
  [[ "$WORKDIR" == gs://?* ]] ||
    die "--workdir must be a gs:// URL for this layout ($P trainer host(s) + $R engine VM(s)): every process reads and writes it, got '${WORKDIR:-<unset, default runs/$NAME>}'; pass --workdir gs://BUCKET/runs/$NAME or set TPU_WORKDIR"
fi
WORKDIR="${WORKDIR:-runs/$NAME}"

coordinator="${trainer_ips[0]}:$COORDINATOR_PORT"
# Every --gin-file given (a composition: one file per concern), else the default's one.
gin_args=("--gin_file=$GIN_FILE")
if ((${#GIN_FILES[@]})); then
  gin_args=()
  for f in "${GIN_FILES[@]}"; do gin_args+=("--gin_file=$f"); done
fi
common=("${gin_args[@]}" "--workdir=$WORKDIR"
  "--gin_param=Processes.trainer_processes = $P"
  "--gin_param=Processes.engine_replicas = $R"
  "--coordinator_address=$coordinator")
keyfile=""
if ((R > 0)); then
  joined_addrs="$(IFS=,; echo "${engine_addrs[*]}")"
  common+=("--engine_addresses=$joined_addrs" "--weight_source=${trainer_ips[0]}:$WEIGHT_PORT"
    "--api_key_file=logs/engine.key")
  key="$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')"
  # Written only once the host's pid check passed (a running run keeps its key), and afresh:
  # an older file of another mode would keep that mode, and the run refuses a key its group or
  # others may read.
  keyfile="(umask 077 && rm -f logs/engine.key && printf '%s' '$key' > logs/engine.key) || exit 1; "
fi
extra="$(quote_all ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"})"

dir="$(quote "$REMOTE_DIR")"
stamp="$(date -u +%Y%m%dT%H%M%SZ)"
# user/: the --with code setup.sh shipped (a user's taskset module), importable by every process
# and by the subprocesses its environment starts; first, so it is what an import finds.
prelude="cd $dir && . .venv/bin/activate && mkdir -p logs || exit 1; \
export PYTHONPATH=\"\$PWD/user\${PYTHONPATH:+:\$PYTHONPATH}\""
pidcheck="if [ -f logs/train.pid ] && kill -0 \"\$(cat logs/train.pid)\" 2>/dev/null; then \
echo \"\$(hostname): training already running (pid \$(cat logs/train.pid))\" >&2; exit 1; fi"

# start_line ROLE PROCESS_INDEX LOG: the detached start of one process (PROCESS_INDEX and LOG
# may hold the remote shell's $wid).
start_line() {
  local role="$1" index="$2" log="$3"
  printf '%s' "nohup python -m jaxrl_orch.train $(quote_all "${common[@]}") \
--process_index=$index${extra:+ $extra} > $log 2>&1 < /dev/null & \
echo \$! > logs/train.pid; echo \"\$(hostname): started $role pid \$!, log $REMOTE_DIR/$log\""
}

# Engine replicas first: the orchestrator on trainer process 0 connects to them.
for ((i = 0; i < R; i++)); do
  remote "$prelude; $pidcheck; $keyfile$(start_line "engine replica $i" "$((P + i))" "logs/engine-$i-$stamp.log")" \
    "$(engine_name "$i")" 0 ||
    die "starting engine replica $i on $(engine_name "$i") failed (see above); engines started before it keep running (README.md: stopping a run)"
done

# Every trainer worker learns its id (= its process index) on the host: TPU_WORKER_ID when
# set, else the TPU VM metadata attribute agent-worker-number (what jax.distributed reads).
worker_id="wid=\"\${TPU_WORKER_ID:-}\"; if [ -z \"\$wid\" ]; then \
wid=\"\$(curl -sf -H 'Metadata-Flavor: Google' \
http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number)\" || wid=; fi; \
case \"\$wid\" in \"\"|*[!0-9]*) echo \"\$(hostname): cannot tell this TPU worker's id \
(TPU_WORKER_ID unset, metadata agent-worker-number unreadable)\" >&2; exit 1;; esac; \
if [ \"\$wid\" -ge $P ]; then echo \"\$(hostname): worker id \$wid is not below the $P trainer processes\" >&2; exit 1; fi"
remote "$prelude; $worker_id; $pidcheck; $keyfile$(start_line "trainer process \$wid" "\"\$wid\"" "logs/trainer-\$wid-$stamp.log")" \
  "$NAME" all ||
  die "starting the trainer processes on $NAME failed on some worker (see above); what started keeps running (README.md: stopping a run)"

if [[ "$DRY_RUN" != 1 ]]; then
  note "started $R engine replica(s) and $P trainer process(es); coordinator $coordinator${joined_addrs:+, engines $joined_addrs}"
  note "follow: gcloud compute tpus tpu-vm ssh $NAME --project=$PROJECT --zone=$ZONE --worker=0 --command='tail -f $REMOTE_DIR/logs/trainer-0-$stamp.log'"
fi
