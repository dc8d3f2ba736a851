#!/usr/bin/env bash
# Delete the TPU VM. Asks for confirmation (gcloud's prompt) unless --yes is given.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

ALLOWED_FLAGS="--project --zone --name --yes"
USAGE="usage: $(basename "$0") [--dry-run] --project P --zone Z --name NAME [--yes]
env: TPU_PROJECT TPU_ZONE TPU_NAME TPU_ASSUME_YES=1"
parse_args "$@"
require_target

target_flags
cmd=(gcloud compute tpus tpu-vm delete "$NAME" "${TARGET_FLAGS[@]}")
case "$ASSUME_YES" in
  1 | true) cmd+=(--quiet) ;;
  0 | false | "") ;;
  *) die "TPU_ASSUME_YES='$ASSUME_YES' is invalid: use 1 or 0" ;;
esac
run "${cmd[@]}"
