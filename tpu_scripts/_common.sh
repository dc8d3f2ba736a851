# shellcheck shell=bash disable=SC2034  # the settings are read by the scripts that source this
# Shared by create.sh, setup.sh, launch.sh and teardown.sh; sourced, never run.
#
# Owns: reading settings from flags or environment variables (flags win), validating them
# with a message naming the flag and the variable, the layout's VM names (the trainer slice
# NAME, engine replica i on NAME-engine-i), and `run`, which either executes a command or,
# under --dry-run, prints it as one copy-pastable shell line. Dry runs never execute or even
# look for gcloud.
#
# Each script sets ALLOWED_FLAGS (space-separated, without values) and USAGE before calling
# `parse_args "$@"`; a flag outside ALLOWED_FLAGS is an error, so a typo never silently
# falls back to a default.

DRY_RUN=0
EXTRA_ARGS=()

PROJECT="${TPU_PROJECT:-${CLOUDSDK_CORE_PROJECT:-}}"
ZONE="${TPU_ZONE:-${CLOUDSDK_COMPUTE_ZONE:-}}"
NAME="${TPU_NAME:-}"
ACCELERATOR_TYPE="${TPU_ACCELERATOR_TYPE:-v5litepod-8}"
RUNTIME_VERSION="${TPU_RUNTIME_VERSION:-}"
ENGINE_REPLICAS="${TPU_ENGINE_REPLICAS:-0}"
ENGINE_ACCELERATOR_TYPE="${TPU_ENGINE_ACCELERATOR_TYPE:-}"
ENGINE_RUNTIME_VERSION="${TPU_ENGINE_RUNTIME_VERSION:-}"
SPOT="${TPU_SPOT:-0}"
RESERVED="${TPU_RESERVED:-0}"
QUEUED="${TPU_QUEUED:-0}"
VALID_UNTIL_DURATION="${TPU_VALID_UNTIL_DURATION:-}"
TIMEOUT_S="${TPU_TIMEOUT_S:-}"
POLL_S="${TPU_POLL_S:-30}"
WORKER="${TPU_WORKER:-all}"
REPO_URL="${TPU_REPO_URL:-}"
REPO_REF="${TPU_REPO_REF:-main}"
REMOTE_DIR="${TPU_REMOTE_DIR:-jaxrl-orch}"
PYTHON="${TPU_PYTHON:-python3.11}"
GIN_FILE="${TPU_GIN_FILE:-configs/tpu_v5e_8.gin}"
WORKDIR="${TPU_WORKDIR:-}"
COORDINATOR_PORT="${TPU_COORDINATOR_PORT:-8476}"
ENGINE_PORT="${TPU_ENGINE_PORT:-50051}"
WEIGHT_PORT="${TPU_WEIGHT_PORT:-8477}"
TRAINER_HOSTS="${TPU_TRAINER_HOSTS:-}"
ASSUME_YES="${TPU_ASSUME_YES:-0}"
EXTRAS="${TPU_EXTRAS:-}"
LOCAL_PYTHON="${TPU_LOCAL_PYTHON:-python3}"
# Repeatable flags: each use adds one. GIN_FILE is the default when no --gin-file is given;
# setup.sh and launch.sh use every file given (a composition: one file per concern).
GIN_FILES=()
GIN_PARAMS=()
WITH_PATHS=()

die() {
  echo "error: $*" >&2
  exit 2
}

note() {
  echo "$*" >&2
}

# Quote one argument for a POSIX shell: bare when it only has safe characters, else
# single-quoted. printf %q would backslash every space, which makes long ssh commands
# unreadable in --dry-run output.
quote() {
  local s="$1"
  if [[ -n "$s" && "$s" =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
    printf '%s' "$s"
  else
    printf "'%s'" "${s//\'/\'\\\'\'}"
  fi
}

# Like quote, but keeps a long flag's name outside the quotes (--command='...') for reading.
quote_all() {
  local out="" a
  for a in "$@"; do
    if [[ "$a" =~ ^(--[A-Za-z0-9_-]+=)(.+)$ ]]; then
      out+="${out:+ }${BASH_REMATCH[1]}$(quote "${BASH_REMATCH[2]}")"
    else
      out+="${out:+ }$(quote "$a")"
    fi
  done
  printf '%s' "$out"
}

run() {
  if [[ "$DRY_RUN" == 1 ]]; then
    quote_all "$@"
    echo
  else
    echo "+ $(quote_all "$@")" >&2
    "$@"
  fi
}

usage() {
  echo "$USAGE"
  echo
  echo "flags: $ALLOWED_FLAGS --dry-run -h|--help"
}

_set_flag() {
  local flag="$1" value="$2"
  case "$flag" in
    --project) PROJECT="$value" ;;
    --zone) ZONE="$value" ;;
    --name) NAME="$value" ;;
    --accelerator-type) ACCELERATOR_TYPE="$value" ;;
    --version) RUNTIME_VERSION="$value" ;;
    --engine-replicas) ENGINE_REPLICAS="$value" ;;
    --engine-accelerator-type) ENGINE_ACCELERATOR_TYPE="$value" ;;
    --engine-version) ENGINE_RUNTIME_VERSION="$value" ;;
    --valid-until-duration) VALID_UNTIL_DURATION="$value" ;;
    --timeout) TIMEOUT_S="$value" ;;
    --poll-interval) POLL_S="$value" ;;
    --worker) WORKER="$value" ;;
    --repo-url) REPO_URL="$value" ;;
    --ref) REPO_REF="$value" ;;
    --remote-dir) REMOTE_DIR="$value" ;;
    --python) PYTHON="$value" ;;
    --gin-file)
      GIN_FILE="$value"
      GIN_FILES+=("$value")
      ;;
    --gin-param) GIN_PARAMS+=("$value") ;;
    --extras) EXTRAS="$value" ;;
    --with) WITH_PATHS+=("$value") ;;
    --workdir) WORKDIR="$value" ;;
    --coordinator-port) COORDINATOR_PORT="$value" ;;
    --engine-port) ENGINE_PORT="$value" ;;
    --weight-port) WEIGHT_PORT="$value" ;;
    --trainer-hosts) TRAINER_HOSTS="$value" ;;
    *) die "unhandled flag $flag" ;;
  esac
}

_allowed() {
  [[ " $ALLOWED_FLAGS " == *" $1 "* ]]
}

_unknown() {
  die "unknown flag $1 for $(basename "$0"); allowed: $ALLOWED_FLAGS --dry-run"
}

parse_args() {
  while (($#)); do
    case "$1" in
      --dry-run) DRY_RUN=1 ;;
      -h | --help)
        usage
        exit 0
        ;;
      --)
        shift
        EXTRA_ARGS=("$@")
        return
        ;;
      --spot | --reserved | --queued | --yes)
        _allowed "$1" || _unknown "$1"
        case "$1" in
          --spot) SPOT=1 ;;
          --reserved) RESERVED=1 ;;
          --queued) QUEUED=1 ;;
          --yes) ASSUME_YES=1 ;;
        esac
        ;;
      --*=*)
        _allowed "${1%%=*}" || _unknown "${1%%=*}"
        _set_flag "${1%%=*}" "${1#*=}"
        ;;
      --*)
        _allowed "$1" || _unknown "$1"
        (($# >= 2)) || die "flag $1 needs a value"
        _set_flag "$1" "$2"
        shift
        ;;
      *) die "unexpected argument '$1' (settings are flags such as --name NAME; see --help)" ;;
    esac
    shift
  done
}

# A yes/no setting given as 1/0 (or true/false), e.g. TPU_SPOT=1; prints 1 or 0.
bool_setting() {
  local label="$1" value="$2"
  case "$value" in
    1 | true) echo 1 ;;
    0 | false | "") echo 0 ;;
    *) die "$label='$value' is invalid: use 1 or 0" ;;
  esac
}

# A non-negative integer setting; names the flag and the variable when it is not one.
int_setting() {
  local flag="$1" var="$2" value="$3"
  [[ "$value" =~ ^[0-9]+$ ]] ||
    die "$flag '$value' is invalid: give a whole number >= 0 (flag $flag or variable $var)"
  echo "$((10#$value))"
}

port_setting() {
  local flag="$1" var="$2" value="$3"
  if ! [[ "$value" =~ ^[0-9]+$ ]] || ((10#$value < 1 || 10#$value > 65535)); then
    die "$flag '$value' is invalid: give a TCP port 1-65535 (flag $flag or variable $var)"
  fi
  echo "$((10#$value))"
}

# Project, zone and TPU name have no sensible defaults: guessing one could create or delete
# a VM somewhere the user did not mean.
require_target() {
  [[ -n "$PROJECT" ]] || die "GCP project is not set: pass --project PROJECT or set TPU_PROJECT"
  [[ -n "$ZONE" ]] || die "zone is not set: pass --zone ZONE (e.g. us-west4-a) or set TPU_ZONE"
  [[ -n "$NAME" ]] || die "TPU name is not set: pass --name NAME or set TPU_NAME"
  # 63 characters at most for a TPU node id; keep room for the engines' "-engine-NNN".
  [[ "$NAME" =~ ^[a-z]([-a-z0-9]{0,46}[a-z0-9])?$ ]] ||
    die "TPU name '$NAME' is invalid: use lowercase letters, digits and '-', starting with a letter, at most 48 characters"
  [[ "$WORKER" == all || "$WORKER" =~ ^[0-9]+(,[0-9]+)*$ ]] ||
    die "worker '$WORKER' is invalid: use 'all' or comma-separated worker indices such as 0,1"
  ENGINE_REPLICAS="$(int_setting --engine-replicas TPU_ENGINE_REPLICAS "$ENGINE_REPLICAS")"
  ((ENGINE_REPLICAS <= 64)) ||
    die "--engine-replicas $ENGINE_REPLICAS is too many (at most 64): each replica is its own TPU VM"
  if [[ "$DRY_RUN" != 1 ]] && ! command -v gcloud >/dev/null 2>&1; then
    die "gcloud not found on PATH; install the Google Cloud CLI or use --dry-run"
  fi
}

# The layout's VMs: the trainer slice, then one single-host VM per engine replica.
engine_name() {
  echo "$NAME-engine-$1"
}

all_vm_names() {
  VM_NAMES=("$NAME")
  local i
  for ((i = 0; i < ENGINE_REPLICAS; i++)); do
    VM_NAMES+=("$(engine_name "$i")")
  done
}

# The TPU VM runtime image that matches each accelerator generation.
default_runtime_version() {
  case "$1" in
    v5litepod-*) echo v2-alpha-tpuv5-lite ;;
    v6e-*) echo v2-alpha-tpuv6e ;;
    v5p-*) echo v2-alpha-tpuv5 ;;
    v4-*) echo tpu-ubuntu2204-base ;;
    *) return 1 ;;
  esac
}

# gcloud flags that locate the TPU VM; every command against it shares them.
target_flags() {
  TARGET_FLAGS=("--project=$PROJECT" "--zone=$ZONE")
}

# Run one shell command line on the selected workers of a VM (default: the trainer slice;
# all of its workers unless --worker says otherwise: every host of a multi-host slice must
# run the same setup and the same training program).
remote() {
  local command="$1" vm="${2:-$NAME}" worker="${3:-$WORKER}"
  target_flags
  run gcloud compute tpus tpu-vm ssh "$vm" "${TARGET_FLAGS[@]}" "--worker=$worker" \
    "--command=$command"
}
