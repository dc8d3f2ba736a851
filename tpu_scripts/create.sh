#!/usr/bin/env bash
# Create a TPU VM (default: a v5e-8, accelerator type v5litepod-8 on runtime
# v2-alpha-tpuv5-lite; pass --accelerator-type v6e-8 for Trillium, whose runtime
# v2-alpha-tpuv6e is then chosen automatically).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

ALLOWED_FLAGS="--project --zone --name --accelerator-type --version --spot"
USAGE="usage: $(basename "$0") [--dry-run] --project P --zone Z --name NAME \
[--accelerator-type v5litepod-8|v6e-8|...] [--version RUNTIME] [--spot]
env: TPU_PROJECT TPU_ZONE TPU_NAME TPU_ACCELERATOR_TYPE TPU_RUNTIME_VERSION TPU_SPOT=1"
parse_args "$@"
require_target

if [[ -z "$RUNTIME_VERSION" ]]; then
  RUNTIME_VERSION="$(default_runtime_version "$ACCELERATOR_TYPE")" ||
    die "no default runtime version for accelerator type '$ACCELERATOR_TYPE' (known: v5litepod-*, v6e-*, v5p-*, v4-*); pass --version or set TPU_RUNTIME_VERSION"
fi

target_flags
cmd=(gcloud compute tpus tpu-vm create "$NAME" "${TARGET_FLAGS[@]}"
  "--accelerator-type=$ACCELERATOR_TYPE" "--version=$RUNTIME_VERSION")
case "$SPOT" in
  1 | true) cmd+=(--spot) ;;
  0 | false | "") ;;
  *) die "TPU_SPOT='$SPOT' is invalid: use 1 or 0" ;;
esac
run "${cmd[@]}"
