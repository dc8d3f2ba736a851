#!/usr/bin/env bash
# Put the code on every worker of every VM of the run (the trainer slice NAME and the
# --engine-replicas R engine VMs NAME-engine-i) and install it into a virtualenv there:
# python venv (Python >= 3.11, installed from apt when the image lacks it), then
# `pip install -e '.[EXTRAS]'`, then a check that JAX sees the local TPU chips.
#
# Extras: tpu (the chips' runtime, libtpu) and gcs (the gs:// workdir) always; those --extras
# names (each checked against pyproject.toml); and, with --gin-file/--gin-param, those the run's
# config needs (python -m jaxrl_orch.tools.extras, run here: verifiers for Data.env =
# 'verifiers', ...).
#
# Code source: with --repo-url, each worker clones it and checks out --ref (default main);
# without, the committed HEAD of this checkout is packed with `git archive` and copied to
# every worker (uncommitted changes are not shipped; commit first).
#
# User code: each --with PATH (a module file, a package directory, or a project directory with a
# pyproject.toml) is packed with tar and unpacked on every worker under REMOTE_DIR/user/, which
# launch.sh puts on every process's PYTHONPATH; a project is also `pip install -e`'d there.
# Nothing from PATH runs on this machine. Each setup replaces REMOTE_DIR/user/ with what it names.
set -euo pipefail
# shellcheck source=_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

ALLOWED_FLAGS="--project --zone --name --engine-replicas --worker --repo-url --ref --remote-dir --python \
--extras --gin-file --gin-param --with"
USAGE="usage: $(basename "$0") [--dry-run] --project P --zone Z --name NAME [--engine-replicas R]
  [--worker all|0,1] [--repo-url URL [--ref BRANCH|COMMIT]] [--remote-dir DIR] [--python python3.11]
  [--extras verifiers,...] [--gin-file F]... [--gin-param B]... [--with PATH]...
--worker picks the trainer slice's workers (default all); engine VMs are single-host.
--extras: pyproject extras to install besides tpu,gcs; --gin-file/--gin-param: the run's config,
  from which the extras it needs are derived (needs a Python here that imports this checkout).
--with: a module file, package directory or pyproject.toml project of yours, shipped to every
  worker under REMOTE_DIR/user/ (on PYTHONPATH in launch.sh); repeatable.
env: TPU_PROJECT TPU_ZONE TPU_NAME TPU_ENGINE_REPLICAS TPU_WORKER TPU_REPO_URL TPU_REPO_REF
  TPU_REMOTE_DIR TPU_PYTHON TPU_EXTRAS TPU_LOCAL_PYTHON (deriving extras; default python3)"
parse_args "$@"
require_target
[[ "$PYTHON" =~ ^python3\.[0-9]+$ ]] ||
  die "python '$PYTHON' is invalid: give an apt-installable interpreter name such as python3.11"
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# The extras pyproject.toml declares (" dev verifiers ..."): the keys of its
# [project.optional-dependencies] table.
declared_extras() {
  local line in_table=0
  while IFS= read -r line; do
    if [[ "$line" == "[project.optional-dependencies]" ]]; then
      in_table=1
    elif [[ "$line" == "["* ]]; then
      in_table=0
    elif ((in_table)) && [[ "$line" =~ ^([A-Za-z0-9_-]+)[[:space:]]*= ]]; then
      printf ' %s' "${BASH_REMATCH[1]}"
    fi
  done <"$repo_root/pyproject.toml"
}

# The extras the config of --gin-file/--gin-param needs, as a comma list, read by the project's
# own config loader: a second list kept by hand here would drift from what the run reads.
derive_extras() {
  local args=() a
  for a in ${GIN_FILES[@]+"${GIN_FILES[@]}"}; do args+=("--gin_file=$a"); done
  for a in ${GIN_PARAMS[@]+"${GIN_PARAMS[@]}"}; do args+=("--gin_param=$a"); done
  # This checkout first on the path: an older installed jaxrl_orch may lack the tool.
  local pypath="$repo_root${PYTHONPATH:+:$PYTHONPATH}"
  if ! command -v "$LOCAL_PYTHON" >/dev/null 2>&1 ||
    ! PYTHONPATH="$pypath" "$LOCAL_PYTHON" -c 'import jaxrl_orch.tools.extras' >/dev/null 2>&1; then
    die "cannot derive the extras from --gin-file here: '$LOCAL_PYTHON' (TPU_LOCAL_PYTHON) cannot import jaxrl_orch from $repo_root (its dependencies are not installed); install them (pip install -e $repo_root) or name the extras with --extras LIST (allowed:$(declared_extras))"
  fi
  PYTHONPATH="$pypath" "$LOCAL_PYTHON" -m jaxrl_orch.tools.extras "${args[@]}" ||
    die "the config given by --gin-file/--gin-param was refused (see above)"
}

# INSTALL_EXTRAS: tpu,gcs, then --extras, then the derived ones; each once, each declared.
resolve_extras() {
  local allowed given=() derived="" derived_list=() e
  allowed="$(declared_extras) "
  IFS=, read -ra given <<<"$EXTRAS"
  if ((${#GIN_FILES[@]} + ${#GIN_PARAMS[@]})); then
    derived="$(derive_extras)" || exit 2
    note "# the config needs the extras: $derived"
  fi
  IFS=, read -ra derived_list <<<"$derived"
  INSTALL_EXTRAS=""
  for e in tpu gcs ${given[@]+"${given[@]}"} ${derived_list[@]+"${derived_list[@]}"}; do
    [[ -z "$e" ]] && continue
    [[ "$allowed" == *" $e "* ]] ||
      die "extra '$e' is not declared in pyproject.toml (flag --extras or variable TPU_EXTRAS); allowed:$(declared_extras)"
    [[ ",$INSTALL_EXTRAS," == *",$e,"* ]] || INSTALL_EXTRAS+="${INSTALL_EXTRAS:+,}$e"
  done
}

# Check every --with path and sort it: USER_TAR_ARGS (tar's -C PARENT NAME pairs) and
# USER_PROJECTS (the names of those holding a pyproject.toml). Names must be distinct and plain:
# each lands on REMOTE_DIR/user/NAME and appears in the remote command line.
check_user_paths() {
  USER_TAR_ARGS=()
  USER_PROJECTS=()
  local p abs base seen=" "
  for p in ${WITH_PATHS[@]+"${WITH_PATHS[@]}"}; do
    if [[ -d "$p" ]]; then
      abs="$(cd "$p" && pwd)"
    elif [[ -f "$p" && "$p" == *.py ]]; then
      abs="$(cd "$(dirname "$p")" && pwd)/$(basename "$p")"
    elif [[ -e "$p" ]]; then
      die "--with '$p' is neither a Python module file (.py) nor a directory"
    else
      die "--with '$p' does not exist"
    fi
    base="$(basename "$abs")"
    [[ "$base" =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]*$ ]] ||
      die "--with '$p': its name '$base' must be letters, digits, '_', '.' or '-'"
    [[ "$seen" != *" $base "* ]] || die "--with: two paths are named '$base'; rename one"
    seen+="$base "
    USER_TAR_ARGS+=(-C "$(dirname "$abs")" "$base")
    if [[ -f "$abs/pyproject.toml" ]]; then
      USER_PROJECTS+=("$base")
    fi
  done
}

resolve_extras
check_user_paths
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
  tarball="${TMPDIR:-/tmp}/jaxrl-orch-src-$NAME.tar.gz"
  remote_tar="jaxrl-orch-src.tar.gz"
  if [[ "$DRY_RUN" != 1 ]]; then
    git -C "$repo_root" rev-parse --git-dir >/dev/null 2>&1 ||
      die "$repo_root is not a git checkout; pass --repo-url URL to clone on the workers instead"
  fi
  run git -C "$repo_root" archive --format=tar.gz "--output=$tarball" HEAD
  steps+=("mkdir -p $dir" "tar -xzf $remote_tar -C $dir" "cd $dir")
fi

# user/ holds exactly what this setup names: a taskset dropped from --with must not linger.
steps+=("rm -rf user")
user_tar="${TMPDIR:-/tmp}/jaxrl-orch-user-$NAME.tar.gz"
remote_user_tar="jaxrl-orch-user.tar.gz"
if ((${#USER_TAR_ARGS[@]})); then
  run tar -czf "$user_tar" --exclude=.git --exclude=__pycache__ '--exclude=*.pyc' --exclude=.venv \
    "${USER_TAR_ARGS[@]}"
  steps+=("mkdir -p user" "tar -xzf ~/$remote_user_tar -C user")
  # A project is kept out of user/ itself: its directory there would be an empty namespace
  # package on PYTHONPATH that shadows the editable install of the same name.
  for p in ${USER_PROJECTS[@]+"${USER_PROJECTS[@]}"}; do
    steps+=("mkdir -p user/.projects" "mv user/$p user/.projects/$p")
  done
fi

steps+=("if ! command -v $py >/dev/null; then sudo apt-get update -q && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -q $py $py-venv; fi"
  "$py -m venv .venv"
  ". .venv/bin/activate"
  "pip install -q -U pip"
  "pip install -e '.[$INSTALL_EXTRAS]'")
for p in ${USER_PROJECTS[@]+"${USER_PROJECTS[@]}"}; do
  steps+=("pip install -e user/.projects/$p")
done
steps+=("python -c 'import jax; print(jax.process_index(), jax.local_devices())'")

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
  if ((${#USER_TAR_ARGS[@]})); then
    run gcloud compute tpus tpu-vm scp "$user_tar" "$vm:$remote_user_tar" "${TARGET_FLAGS[@]}" \
      "--worker=$worker"
  fi
  remote "$joined" "$vm" "$worker"
done
