# shellcheck shell=bash
# Sourced by the one-GPU job scripts (`source "$(dirname "$0")/prologue.sh" "$@"`): STACK WORK DEST from their
# arguments, the stack on the path (TE=te: Transformer Engine too), the repository on PYTHONPATH and as the
# working directory, the GPU in DEST/gpus.txt, and say() appending a timestamped line to DEST/status.
STACK=${1:?stack}; WORK=${2:?work dir}; DEST=${3:?dest}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
mkdir -p "$WORK" "$DEST"
cd "$ROOT" || exit 1
# shellcheck disable=SC1091
source "$STACK/env.sh" ${TE:-}
export PYTHONPATH=$ROOT:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader > "$DEST/gpus.txt"
say() { echo "$(date -u +%T) $*" >> "$DEST/status"; }
