#!/usr/bin/env bash
# On a GPU host with the stack installed (install_stack.sh): mrl's GPU checks, each job on its own GPUs, side by
# side. Every job logs to WORK/<job>.log; results (JSON, PNG, summaries, logs; no checkpoints) are packed into
# DEST/gpu_checks.tgz at the end.
#   scripts/gpu/run_checks.sh STACK WORK DEST JOB=GPUS[,te] ...      e.g. learn=0,1,te loop=2,3 parity=0,1,te
# Jobs: scripts/gpu/jobs.sh.
# ",te" puts Transformer Engine on the job's path (megatron's TE spec); without it the local spec runs.
set -uo pipefail
STACK=${1:?stack}; WORK=${2:?work dir}; DEST=${3:?dest}; shift 3
ROOT=$(cd "$(dirname "$0")/../.." && pwd)

# shellcheck source=jobs.sh
source "$ROOT/scripts/gpu/jobs.sh"
export TIMEOUT=${TIMEOUT:-560}
prepare_work

for spec in "$@"; do
  name=${spec%%=*}; rest=${spec#*=}; te=""
  case $rest in *,te) te=te; rest=${rest%,te} ;; esac
  job "$name" "$rest" "$te" &
done
wait
for spec in "$@"; do
  name=${spec%%=*}
  echo "== $name: rc $(cat "$WORK/$name.rc")"; tail -n 4 "$WORK/$name.log"
done
tar czf "$DEST/gpu_checks.tgz" -C "$WORK" --exclude='model_*' --exclude='tiny' --exclude='checkpoints' \
  --exclude='*.safetensors' --exclude='weights' .
ls -la "$DEST"
