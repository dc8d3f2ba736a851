#!/usr/bin/env bash
# Create the run's TPU VMs: the trainer slice NAME (--accelerator-type, default v5litepod-8,
# i.e. a v5e-8; a multi-host type such as v5litepod-16 gives one trainer process per host)
# and --engine-replicas R single-host engine VMs NAME-engine-0 .. NAME-engine-(R-1)
# (--engine-accelerator-type, default the trainer's generation at 8: v5litepod-8, v6e-8, ...).
#
# Directly (`gcloud compute tpus tpu-vm create`, which waits for each VM), or with --queued
# through one queued resource per VM (`gcloud compute tpus queued-resources create QR
# --node-id=QR`, id = VM name), then polls `queued-resources describe` until every request is
# ACTIVE: bounded by --timeout seconds, and an error as soon as one is FAILED or SUSPENDED.
set -euo pipefail
# shellcheck source=_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

ALLOWED_FLAGS="--project --zone --name --accelerator-type --version --engine-replicas \
--engine-accelerator-type --engine-version --spot --reserved --queued --valid-until-duration \
--timeout --poll-interval"
USAGE="usage: $(basename "$0") [--dry-run] --project P --zone Z --name NAME
  [--accelerator-type v5litepod-8|v5litepod-16|v6e-8|...] [--version RUNTIME]
  [--engine-replicas R [--engine-accelerator-type v5litepod-8] [--engine-version RUNTIME]]
  [--spot | --reserved] [--queued [--valid-until-duration 6h] [--timeout S] [--poll-interval S]]
env: TPU_PROJECT TPU_ZONE TPU_NAME TPU_ACCELERATOR_TYPE TPU_RUNTIME_VERSION TPU_ENGINE_REPLICAS
  TPU_ENGINE_ACCELERATOR_TYPE TPU_ENGINE_RUNTIME_VERSION TPU_SPOT=1 TPU_RESERVED=1 TPU_QUEUED=1
  TPU_VALID_UNTIL_DURATION TPU_TIMEOUT_S (default 7200) TPU_POLL_S (default 30)"
parse_args "$@"
require_target

SPOT="$(bool_setting TPU_SPOT "$SPOT")"
RESERVED="$(bool_setting TPU_RESERVED "$RESERVED")"
QUEUED="$(bool_setting TPU_QUEUED "$QUEUED")"
[[ "$SPOT$RESERVED" != 11 ]] ||
  die "--spot and --reserved exclude each other: a VM is either Spot capacity or from a reservation"
if [[ -n "$VALID_UNTIL_DURATION" ]]; then
  [[ "$QUEUED" == 1 ]] ||
    die "--valid-until-duration applies to queued resources only: add --queued (or set TPU_QUEUED=1)"
  [[ "$VALID_UNTIL_DURATION" =~ ^([0-9]+[dhms])+$ ]] ||
    die "--valid-until-duration '$VALID_UNTIL_DURATION' is invalid: use a gcloud duration such as 6h, 90m or 1d"
fi
TIMEOUT_S="$(int_setting --timeout TPU_TIMEOUT_S "${TIMEOUT_S:-7200}")"
POLL_S="$(int_setting --poll-interval TPU_POLL_S "$POLL_S")"

if [[ -z "$RUNTIME_VERSION" ]]; then
  RUNTIME_VERSION="$(default_runtime_version "$ACCELERATOR_TYPE")" ||
    die "no default runtime version for accelerator type '$ACCELERATOR_TYPE' (known: v5litepod-*, v6e-*, v5p-*, v4-*); pass --version or set TPU_RUNTIME_VERSION"
fi

if ((ENGINE_REPLICAS > 0)); then
  generation="${ACCELERATOR_TYPE%-*}"
  if [[ -z "$ENGINE_ACCELERATOR_TYPE" ]]; then
    default_runtime_version "$ACCELERATOR_TYPE" >/dev/null ||
      die "no default engine accelerator type for '$ACCELERATOR_TYPE'; pass --engine-accelerator-type or set TPU_ENGINE_ACCELERATOR_TYPE"
    ENGINE_ACCELERATOR_TYPE="$generation-8"
  fi
  # An engine replica is one process on one host. For the known generations the suffix
  # counts chips (v5e, v6e) or TensorCores (v4, v5p); more than 8 spans several hosts.
  if default_runtime_version "$ENGINE_ACCELERATOR_TYPE" >/dev/null; then
    size="${ENGINE_ACCELERATOR_TYPE##*-}"
    if ! [[ "$size" =~ ^[0-9]+$ ]] || ((size > 8)); then
      die "engine accelerator type '$ENGINE_ACCELERATOR_TYPE' is multi-host: each engine replica must be a single-host TPU VM (e.g. ${ENGINE_ACCELERATOR_TYPE%-*}-8)"
    fi
  fi
  if [[ -z "$ENGINE_RUNTIME_VERSION" ]]; then
    if [[ "${ENGINE_ACCELERATOR_TYPE%-*}" == "$generation" ]]; then
      ENGINE_RUNTIME_VERSION="$RUNTIME_VERSION"
    else
      ENGINE_RUNTIME_VERSION="$(default_runtime_version "$ENGINE_ACCELERATOR_TYPE")" ||
        die "no default runtime version for engine accelerator type '$ENGINE_ACCELERATOR_TYPE'; pass --engine-version or set TPU_ENGINE_RUNTIME_VERSION"
    fi
  fi
fi

target_flags
capacity=()
[[ "$SPOT" == 1 ]] && capacity+=(--spot)
[[ "$RESERVED" == 1 ]] && capacity+=(--reserved)

# create_one VM ACCELERATOR_TYPE RUNTIME_VERSION
create_one() {
  local vm="$1" type="$2" version="$3" cmd
  if [[ "$QUEUED" == 1 ]]; then
    cmd=(gcloud compute tpus queued-resources create "$vm" "${TARGET_FLAGS[@]}"
      "--node-id=$vm" "--accelerator-type=$type" "--runtime-version=$version")
    [[ -n "$VALID_UNTIL_DURATION" ]] && cmd+=("--valid-until-duration=$VALID_UNTIL_DURATION")
  else
    cmd=(gcloud compute tpus tpu-vm create "$vm" "${TARGET_FLAGS[@]}"
      "--accelerator-type=$type" "--version=$version")
  fi
  cmd+=(${capacity[@]+"${capacity[@]}"})
  run "${cmd[@]}" ||
    die "creating $vm failed (see gcloud's message above); VMs or requests already created stay: tpu_scripts/teardown.sh deletes them"
}

all_vm_names
create_one "$NAME" "$ACCELERATOR_TYPE" "$RUNTIME_VERSION"
for ((i = 0; i < ENGINE_REPLICAS; i++)); do
  create_one "$(engine_name "$i")" "$ENGINE_ACCELERATOR_TYPE" "$ENGINE_RUNTIME_VERSION"
done

[[ "$QUEUED" == 1 ]] || exit 0

# Wait until every queued resource is ACTIVE (its VM exists and runs).
state_cmd() {
  STATE_CMD=(gcloud compute tpus queued-resources describe "$1" "${TARGET_FLAGS[@]}"
    "--format=value(state.state)")
}
if [[ "$DRY_RUN" == 1 ]]; then
  for vm in "${VM_NAMES[@]}"; do
    state_cmd "$vm"
    run "${STATE_CMD[@]}"
  done
  note "# dry run: a real run repeats each describe every ${POLL_S}s until ACTIVE (at most ${TIMEOUT_S}s)"
  exit 0
fi

pending=("${VM_NAMES[@]}")
start=$SECONDS
while :; do
  waiting=()
  for vm in "${pending[@]}"; do
    state_cmd "$vm"
    state="$("${STATE_CMD[@]}")" ||
      die "could not read the state of queued resource $vm (see gcloud's message above)"
    state="${state//[[:space:]]/}"
    case "$state" in
      ACTIVE) note "queued resource $vm: ACTIVE" ;;
      FAILED | SUSPENDING | SUSPENDED)
        die "queued resource $vm is $state: the request will not be granted. Details: gcloud compute tpus queued-resources describe $vm --project=$PROJECT --zone=$ZONE; delete the requests with tpu_scripts/teardown.sh"
        ;;
      *) waiting+=("$vm:${state:-UNKNOWN}") ;;
    esac
  done
  ((${#waiting[@]} == 0)) && break
  elapsed=$((SECONDS - start))
  if ((elapsed >= TIMEOUT_S)); then
    die "queued resources not ACTIVE after ${TIMEOUT_S}s: ${waiting[*]}. The requests stay queued: follow them with gcloud compute tpus queued-resources list --project=$PROJECT --zone=$ZONE, or delete them with tpu_scripts/teardown.sh"
  fi
  note "waiting for queued resources (${elapsed}s of ${TIMEOUT_S}s): ${waiting[*]}"
  pending=()
  for w in "${waiting[@]}"; do pending+=("${w%%:*}"); done
  sleep "$POLL_S"
done
note "all ${#VM_NAMES[@]} queued resources are ACTIVE: ${VM_NAMES[*]}"
