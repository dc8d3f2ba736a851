#!/usr/bin/env bash
# Delete every VM and queued resource of the run: those named NAME (the trainer slice) or
# NAME-engine-<i> (the engine replicas), whatever --engine-replicas was, found with
# `queued-resources list` and `tpu-vm list`. A queued resource is deleted with --force (which
# deletes its VM too); a VM made without one with `tpu-vm delete`. The deletes run
# --async, then the lists are polled until none of them is left, at most --timeout seconds.
# Idempotent: with nothing left it says so and exits 0. Asks for confirmation (gcloud's
# prompt, one per delete) unless --yes is given.
set -euo pipefail
# shellcheck source=_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

ALLOWED_FLAGS="--project --zone --name --yes --timeout --poll-interval"
USAGE="usage: $(basename "$0") [--dry-run] --project P --zone Z --name NAME [--yes]
  [--timeout S (default 1800)] [--poll-interval S (default 30)]
env: TPU_PROJECT TPU_ZONE TPU_NAME TPU_ASSUME_YES=1 TPU_TIMEOUT_S TPU_POLL_S"
parse_args "$@"
require_target
ASSUME_YES="$(bool_setting TPU_ASSUME_YES "$ASSUME_YES")"
TIMEOUT_S="$(int_setting --timeout TPU_TIMEOUT_S "${TIMEOUT_S:-1800}")"
POLL_S="$(int_setting --poll-interval TPU_POLL_S "$POLL_S")"

target_flags
yes=()
[[ "$ASSUME_YES" == 1 ]] && yes=(--quiet)

list_cmd() {
  LIST_CMD=(gcloud compute tpus "$1" list "${TARGET_FLAGS[@]}" "--format=value(name.basename())")
}
qr_delete_cmd() {
  DELETE_CMD=(gcloud compute tpus queued-resources delete "$1" "${TARGET_FLAGS[@]}" --force --async
    ${yes[@]+"${yes[@]}"})
}
vm_delete_cmd() {
  DELETE_CMD=(gcloud compute tpus tpu-vm delete "$1" "${TARGET_FLAGS[@]}" --async
    ${yes[@]+"${yes[@]}"})
}

if [[ "$DRY_RUN" == 1 ]]; then
  list_cmd queued-resources
  run "${LIST_CMD[@]}"
  list_cmd tpu-vm
  run "${LIST_CMD[@]}"
  qr_delete_cmd "$NAME"
  run "${DELETE_CMD[@]}"
  vm_delete_cmd "$NAME"
  run "${DELETE_CMD[@]}"
  note "# dry run: a real run deletes what the two lists show named $NAME or $NAME-engine-<i>:" \
    "queued resources as in the first delete (--force takes their VMs too), other VMs as in" \
    "the second; then lists again every ${POLL_S}s until they are gone (at most ${TIMEOUT_S}s)"
  exit 0
fi

# ours KIND: sets OURS to the names of this run's resources of one kind.
ours() {
  local out name
  list_cmd "$1"
  out="$(run "${LIST_CMD[@]}")" || die "could not list the $1 in $ZONE (see gcloud's message above)"
  OURS=()
  while read -r name; do
    name="${name##*/}"
    if [[ "$name" == "$NAME" || "$name" =~ ^$NAME-engine-[0-9]+$ ]]; then
      OURS+=("$name")
    fi
  done <<<"$out"
}

ours queued-resources
qrs=(${OURS[@]+"${OURS[@]}"})
ours tpu-vm
vms=(${OURS[@]+"${OURS[@]}"})
if ((${#qrs[@]} + ${#vms[@]} == 0)); then
  note "nothing to delete: no queued resource or TPU VM named $NAME or $NAME-engine-<i> in $PROJECT/$ZONE"
  exit 0
fi

failed=()
for qr in ${qrs[@]+"${qrs[@]}"}; do
  qr_delete_cmd "$qr"
  run "${DELETE_CMD[@]}" || failed+=("queued resource $qr")
done
for vm in ${vms[@]+"${vms[@]}"}; do
  # A VM made through a queued resource (same id) goes with it.
  [[ " ${qrs[*]-} " == *" $vm "* ]] && continue
  vm_delete_cmd "$vm"
  run "${DELETE_CMD[@]}" || failed+=("TPU VM $vm")
done
((${#failed[@]} == 0)) ||
  note "delete failed for: ${failed[*]} (it may already be deleting); waiting to see"

start=$SECONDS
while :; do
  left=()
  ours queued-resources
  for n in ${OURS[@]+"${OURS[@]}"}; do left+=("queued resource $n"); done
  ours tpu-vm
  for n in ${OURS[@]+"${OURS[@]}"}; do left+=("TPU VM $n"); done
  ((${#left[@]} == 0)) && break
  elapsed=$((SECONDS - start))
  ((elapsed < TIMEOUT_S)) ||
    die "still there after ${TIMEOUT_S}s: ${left[*]}; run teardown.sh again, or check the Cloud console"
  note "waiting for deletion (${elapsed}s of ${TIMEOUT_S}s): ${left[*]}"
  sleep "$POLL_S"
done
note "deleted: every queued resource and TPU VM named $NAME or $NAME-engine-<i>"
