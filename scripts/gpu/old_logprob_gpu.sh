#!/usr/bin/env bash
# On a one-GPU host (80 GB or more) with the stack installed (install_stack.sh): what pi_old's forward pass costs
# (issue 56's goal: <= 25% of the RL step it precedes) on the Qwen3-30B-A3B slice, bench/old_logprob_pass.py:
# 8 layers, bf16 weights and Adam states (Transformer Engine's FusedAdam: TE is on the path unless TE is set to
# the empty string), 4 mini-batches of 8 samples x 2048 tokens, micro-batches of 1, and the pass also in
# micro-batches of its own (OLP_OWN samples, default 2: algo.old_logprob_micro_batch_size), 8 pairs; OLP_ARGS
# replaces those arguments.
# Where TE does not import, fp32 Adam states leave room for 5 layers on 80 GB: that slice is run instead, and the
# status says so.
# Meant to run detached (setsid) while short calls read DEST/status and collect DEST's files: the report
# DEST/old_logprob_pass.json, the log, gpus.txt.
#   scripts/gpu/old_logprob_gpu.sh STACK WORK DEST
set -uo pipefail
STACK=${1:?stack}; WORK=${2:?work dir}; DEST=${3:?dest}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$WORK" "$DEST"
cd "$ROOT"
# shellcheck disable=SC1091
source "$STACK/env.sh" ${TE-te}
export PYTHONPATH=$ROOT:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader > "$DEST/gpus.txt"
say() { echo "$(date -u +%T) $*" >> "$DEST/status"; }

batch="--samples 32 --seq 2048 --mini-batches 4 --micro-batch-size 1 --old-micro-batch-size ${OLP_OWN:-2} --pairs 8"
slice="--shape qwen3_30b_a3b --layers 8 --optimizer-states bf16"
if ! python3 -c "import transformer_engine.pytorch" 2>/dev/null; then
  slice="--shape qwen3_30b_a3b --layers 5 --optimizer-states fp32"
  say "Transformer Engine does not import: no bf16 Adam states, the 5-layer slice with fp32 states instead"
fi
say "old_logprob_pass start: ${OLP_ARGS:-$slice $batch}"
# shellcheck disable=SC2086
timeout "${OLP_TIMEOUT:-420}" python3 bench/old_logprob_pass.py --model-dir "$WORK/models" ${OLP_ARGS:-$slice $batch} \
  --json "$DEST/old_logprob_pass.json" > "$DEST/old_logprob_pass.log" 2>&1
rc=$?
say "old_logprob_pass rc $rc"
grep -E "^pi_old's pass" "$DEST/old_logprob_pass.log" >> "$DEST/status"  # both figures
say "done"
exit $rc
