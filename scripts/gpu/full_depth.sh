#!/usr/bin/env bash
# On a one-GPU host with the stack installed (install_stack.sh): issue 61, the full 48-layer Qwen3-30B-A3B with
# no checkpoint on disk (bench/full_depth.py: only config.json; the engine and the trainer draw the same synthetic
# weights), LoRA on attention and every expert, Keep Routing replay off and on at full depth.
#   scripts/gpu/full_depth.sh STACK WORK DEST [sequential|colocated]
# The mode defaults by the GPU's memory: colocated (engine beside the trainer, memory saver, adapter syncs,
# FULL_DEPTH_STEPS GRPO steps, default 5) on an H200, sequential (engine, then the trainer alone: mismatch and
# LoRA GRPO steps with small micro-batches) on an 80 GB H100. A colocated run that fails is followed by a
# sequential one, so the call still brings the mismatch and memory reports. FULL_DEPTH_ARGS: more flags
# (e.g. --layers 24 --lora-rank 4). DEST gets, per mode run, the report (its name holds full_depth), the
# output and the tails of the workers' and the engine's logs, and one status file (the GPU, each step's rc).
set -uo pipefail
STACK=${1:?stack}; WORK=${2:?work dir}; DEST=${3:?dest}; MODE=${4:-}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$WORK" "$DEST"
cd "$ROOT"
# shellcheck disable=SC1091
source "$STACK/env.sh" te
export PYTHONPATH=$ROOT:${PYTHONPATH:-} PYTHONUNBUFFERED=1 MRL_LAUNCHED_AT=${MRL_LAUNCHED_AT:-$(date +%s.%N)}
say() { echo "$(date -u +%T) $*" | tee -a "$DEST/status"; }
say "gpu: $(nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader | tr '\n' ' ')"
if [ -z "$MODE" ]; then
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  if [ "${mib:-0}" -gt 100000 ]; then MODE=colocated; else MODE=sequential; fi
fi
gpu=$(python3 -c "import sys; sys.path.insert(0, 'bench'); from _bench_common import device_name, slug; print(slug(device_name()))")

run() {  # MODE TIMEOUT EXTRA...
  local mode=$1 limit=$2; shift 2
  local out="$WORK/$mode"
  rm -rf "$out"
  say "$mode start"
  # shellcheck disable=SC2086
  timeout "$limit" python3 bench/full_depth.py --mode "$mode" --out "$out" \
    --json "$DEST/$(date -u +%F)_full_depth_${mode}_qwen3_30b_a3b_l48_${gpu}.json" "$@" ${FULL_DEPTH_ARGS:-} > "$DEST/${mode}.log" 2>&1
  local rc=$?
  say "$mode rc $rc"
  for f in "$out"/*.log "$out"/engines/*.log; do  # one file per mode: a device call brings back 8 files
    [ -f "$f" ] && { echo "=== $(basename "$f")"; tail -c 20000 "$f"; } >> "$DEST/${mode}_logs.txt"
  done
  return $rc
}

BUDGET=${FULL_DEPTH_BUDGET:-570}  # seconds this script may take in all (a device call: 600)
if [ "$MODE" = colocated ]; then
  # r=4: the trainer's 60.4 GiB of model states beside the engine's 57 GiB of weights (docs/memory.md)
  if ! run colocated "${COLOCATED_TIMEOUT:-480}" --steps "${FULL_DEPTH_STEPS:-5}" --lora-rank 4 --prompts 4; then
    left=$((BUDGET - SECONDS))
    if [ "$left" -gt 240 ]; then run sequential "$left" --steps 2 --lora-rank 8; else say "no time left for sequential"; fi
  fi
else
  run sequential "$((BUDGET - SECONDS))" --steps "${FULL_DEPTH_STEPS:-3}" --lora-rank 8
fi
say "done"
