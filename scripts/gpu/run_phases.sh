#!/usr/bin/env bash
# On a GPU host with the stack installed: jobs of scripts/gpu/jobs.sh in phases, one phase after another, the
# jobs of a phase side by side on their own GPUs. Meant to run detached (setsid) while short calls collect
# what is done: WORK/status says which phase runs, and each finished phase's results (JSON, PNG, logs; no
# checkpoints or weights) are packed into DEST/phase<i>.tgz at once.
#   scripts/gpu/run_phases.sh STACK WORK DEST 'e2e2=0,1,te+loops48=2,3' 'loops4=0,1,2,3,te' ...
set -uo pipefail
STACK=${1:?stack}; WORK=${2:?work dir}; DEST=${3:?dest}; shift 3
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=jobs.sh
source "$ROOT/scripts/gpu/jobs.sh"
export TIMEOUT=${TIMEOUT:-1500}
prepare_work

p=0
for phase in "$@"; do
  p=$((p + 1))
  echo "$(date -u +%T) phase $p start: $phase" >> "$WORK/status"
  IFS='+' read -ra specs <<< "$phase"
  names=()
  for spec in "${specs[@]}"; do
    name=${spec%%=*}; rest=${spec#*=}; te=""
    case $rest in *,te) te=te; rest=${rest%,te} ;; esac
    names+=("$name")
    job "$name" "$rest" "$te" &
  done
  wait
  for name in "${names[@]}"; do
    echo "$(date -u +%T) phase $p $name rc $(cat "$WORK/$name.rc")" >> "$WORK/status"
  done
  (cd "$WORK" && tar czf "$DEST/phase$p.tgz" --exclude='model_*' --exclude='tiny' --exclude='checkpoints' \
     --exclude='*.safetensors' --exclude='weights' --exclude='work' \
     "${names[@]/%/.log}" "${names[@]/%/.rc}" $(for n in "${names[@]}"; do ls -d "$n" "$n"_* 2>/dev/null; done) \
     gpus.txt status)
done
echo "$(date -u +%T) done" >> "$WORK/status"
