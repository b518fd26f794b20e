#!/usr/bin/env bash
# On a host with two GPUs and the stack installed (install_stack.sh, Transformer Engine on the path): issue 59's
# context-parallelism runs, one after the other, meant to run detached (setsid) while short calls read
# WORK/status and collect DEST's files.
#   1. bench/cp2_vs_cp1.py: Policy with parallel.cp=2 against CP=1 on the same batch, the same 2 GPUs and EP2,
#      on the Qwen3-30B-A3B slice (12 layers) at 16k-token responses (CP_ARGS), Keep Routing on: the report
#      DEST/<date>_context_parallel_cp2_vs_cp1_*.json (max_abs_logprob_diff_vs_cp1, route_agreement_replay_on,
#      step_s, peak_memory_gib);
#   2. mrl train with parallel.cp=2 on model=small_gpu, the engine sharing GPU 0 (CUDA IPC weight sync), a few
#      steps (TRAIN_STEPS, default 5): CP from the loop itself.
#   scripts/gpu/cp2.sh STACK WORK DEST
set -uo pipefail
STACK=${1:?stack}; WORK=${2:?work dir}; DEST=${3:?dest}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$WORK" "$DEST"
cd "$ROOT"
# shellcheck disable=SC1091
source "$STACK/env.sh" te
export PYTHONPATH=$ROOT:$PYTHONPATH PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader > "$DEST/gpus.txt"
say() { echo "$(date -u +%T) $*" >> "$DEST/status"; }
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] || { say "needs 2 GPUs"; exit 2; }

say "cp2_vs_cp1 start"
# shellcheck disable=SC2086
timeout "${CP_TIMEOUT:-3600}" python3 bench/cp2_vs_cp1.py --work "$WORK/cp" \
  --out "$DEST/$(date -u +%F)_context_parallel_cp2_vs_cp1.json" ${CP_ARGS:---response 16384} \
  > "$DEST/cp2_vs_cp1.log" 2>&1
say "cp2_vs_cp1 rc $?"

say "train start"
timeout "${TRAIN_TIMEOUT:-1200}" python3 -m mrl train model=small_gpu engine=gpu model.dtype=bf16 \
  parallel.cp=2 parallel.world_size=2 weight_sync.transport=tensor engine.base_gpu_id=0 \
  engine.mem_fraction_static=0.25 train.steps="${TRAIN_STEPS:-5}" train.eval_every=0 \
  run_dir="$WORK/train_cp2" > "$DEST/train_cp2.log" 2>&1
say "train rc $?"
cp "$WORK"/train_cp2/summary.json "$DEST/train_cp2_summary.json" 2>/dev/null
tail -n 5 "$WORK"/train_cp2/metrics.jsonl > "$DEST/train_cp2_metrics_tail.jsonl" 2>/dev/null
say "done"
