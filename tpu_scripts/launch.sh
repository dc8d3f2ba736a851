#!/usr/bin/env bash
# Start training on every worker, detached (nohup), logging to REMOTE_DIR/logs/ on each.
# Arguments after `--` are passed to `python -m jaxrl_orch.train` unchanged (for example
# --gin_param=...). Refuses to start when the pid recorded by a previous launch is alive.
#
# --workdir: a gs:// path for multi-host slices (every host must see the same checkpoints),
# or a local path (relative to REMOTE_DIR) for a single-host v5e-8 / v6e-8; default
# runs/NAME.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

ALLOWED_FLAGS="--project --zone --name --worker --remote-dir --gin-file --workdir"
USAGE="usage: $(basename "$0") [--dry-run] --project P --zone Z --name NAME [--worker all|0,1]
  [--remote-dir DIR] [--gin-file configs/tpu_v5e_8.gin] [--workdir gs://BUCKET/run|runs/x]
  [-- extra train args]
env: TPU_PROJECT TPU_ZONE TPU_NAME TPU_WORKER TPU_REMOTE_DIR TPU_GIN_FILE TPU_WORKDIR"
parse_args "$@"
require_target
[[ -n "$GIN_FILE" ]] || die "gin file is empty: pass --gin-file configs/<name>.gin"
WORKDIR="${WORKDIR:-runs/$NAME}"

dir="$(quote "$REMOTE_DIR")"
stamp="$(date -u +%Y%m%dT%H%M%SZ)"
log="logs/train-$stamp.log"
train=(python -m jaxrl_orch.train "--gin_file=$GIN_FILE" "--workdir=$WORKDIR"
  ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"})

remote "cd $dir && . .venv/bin/activate && mkdir -p logs || exit 1; \
if [ -f logs/train.pid ] && kill -0 \"\$(cat logs/train.pid)\" 2>/dev/null; then \
echo \"\$(hostname): training already running (pid \$(cat logs/train.pid))\" >&2; exit 1; fi; \
nohup $(quote_all "${train[@]}") > $log 2>&1 < /dev/null & \
echo \$! > logs/train.pid; echo \"\$(hostname): started pid \$!, log $REMOTE_DIR/$log\""
