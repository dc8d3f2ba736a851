#!/usr/bin/env bash
# Put the code on every worker of every VM of the run (the trainer slice NAME and the
# --engine-replicas R engine VMs NAME-engine-i) and install it into a virtualenv there:
# python venv (Python >= 3.11, installed from apt when the image lacks it), then
# `pip install -e '.[tpu,gcs]'` (libtpu for the chips, gcsfs for the gs:// workdir), then a
# check that JAX sees the local TPU chips.
#
# Code source: with --repo-url, each worker clones it and checks out --ref (default main);
# without, the committed HEAD of this checkout is packed with `git archive` and copied to
# every worker (uncommitted changes are not shipped; commit first).
set -euo pipefail
# shellcheck source=_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

ALLOWED_FLAGS="--project --zone --name --engine-replicas --worker --repo-url --ref --remote-dir --python"
USAGE="usage: $(basename "$0") [--dry-run] --project P --zone Z --name NAME [--engine-replicas R]
  [--worker all|0,1] [--repo-url URL [--ref BRANCH|COMMIT]] [--remote-dir DIR] [--python python3.11]
--worker picks the trainer slice's workers (default all); engine VMs are single-host.
env: TPU_PROJECT TPU_ZONE TPU_NAME TPU_ENGINE_REPLICAS TPU_WORKER TPU_REPO_URL TPU_REPO_REF
  TPU_REMOTE_DIR TPU_PYTHON"
parse_args "$@"
require_target
[[ "$PYTHON" =~ ^python3\.[0-9]+$ ]] ||
  die "python '$PYTHON' is invalid: give an apt-installable interpreter name such as python3.11"

dir="$(quote "$REMOTE_DIR")"
py="$PYTHON"
steps=()
all_vm_names
target_flags

if [[ -n "$REPO_URL" ]]; then
  ref="$(quote "$REPO_REF")"
  # A branch is checked out at the remote's tip; anything else (tag, commit) as given.
  steps+=("if [ ! -d $dir/.git ]; then git clone $(quote "$REPO_URL") $dir; fi"
    "cd $dir"
    "git fetch --tags origin"
    "(git checkout --detach origin/$ref 2>/dev/null || git checkout --detach $ref)")
else
  repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  tarball="${TMPDIR:-/tmp}/jaxrl-orch-src-$NAME.tar.gz"
  remote_tar="jaxrl-orch-src.tar.gz"
  if [[ "$DRY_RUN" != 1 ]]; then
    git -C "$repo_root" rev-parse --git-dir >/dev/null 2>&1 ||
      die "$repo_root is not a git checkout; pass --repo-url URL to clone on the workers instead"
  fi
  run git -C "$repo_root" archive --format=tar.gz "--output=$tarball" HEAD
  steps+=("mkdir -p $dir" "tar -xzf $remote_tar -C $dir" "cd $dir")
fi

steps+=("if ! command -v $py >/dev/null; then sudo apt-get update -q && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -q $py $py-venv; fi"
  "$py -m venv .venv"
  ". .venv/bin/activate"
  "pip install -q -U pip"
  "pip install -e '.[tpu,gcs]'"
  "python -c 'import jax; print(jax.process_index(), jax.local_devices())'")

joined="set -e"
for s in "${steps[@]}"; do
  joined+="; $s"
done

for vm in "${VM_NAMES[@]}"; do
  worker=all
  [[ "$vm" == "$NAME" ]] && worker="$WORKER"
  if [[ -z "$REPO_URL" ]]; then
    run gcloud compute tpus tpu-vm scp "$tarball" "$vm:$remote_tar" "${TARGET_FLAGS[@]}" \
      "--worker=$worker"
  fi
  remote "$joined" "$vm" "$worker"
done
