#!/usr/bin/env bash
# FP8 rollouts with bf16 training on 2 GPUs: the trainer (megatron, bf16) on the first GPU, an SGLang
# engine started from the run's block-FP8 export (--quantization fp8 --dtype bfloat16) on the second; one FP8
# weight sync over NCCL (one GPU visible: the engine beside the trainer, the sync over CUDA IPC), then the
# engine's sampled tensors (first and last layer, experts included, each FP8 weight as SGLang's weight checker
# reports it: dequantized with its scales) against the trainer's quantization bit for bit, and the engine's
# probe logprobs against the trainer's with the dequantized weights (tests/jobs/fp8_sync_check.py). Hopper
# only: on Blackwell SGLang requantizes block scales for DeepGEMM at load, which a weight update does not
# redo (docs/fp8.md). Needs the whole GPU stack (SGLang's GPU kernels): scripts/gpu/install_stack.sh.
#   bash tests/gpu/fp8_sync.sh [OUT_DIR]        -> OUT_DIR/fp8_sync.json, OUT_DIR/run/engines/*.log
#   FP8_IGNORE="model.layers.0" bash tests/gpu/fp8_sync.sh ...   (engine.fp8_ignore: those modules stay bf16)
set -uo pipefail
OUT=${1:-${OUT:-runs/gpu_fp8_sync}}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1}
# one GPU: the engine beside the trainer, the FP8 buckets over CUDA IPC (weight_sync.transport=tensor)
ONE_GPU=(); case $CUDA_VISIBLE_DEVICES in *,*) ;; *) ONE_GPU=(--engine-gpu 0 --transport tensor) ;; esac
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpus.txt"
M=/tmp/mrl_models
python3 -m mrl make-tiny-model $M/tiny_gpu --preset tiny_gpu >/dev/null || exit 1
python3 -m torch.distributed.run --standalone --nproc-per-node=1 -m tests.jobs.fp8_sync_check --hf $M/tiny_gpu \
  --run-dir "$OUT/run" --out "$OUT/fp8_sync.json" "${ONE_GPU[@]}" ${FP8_IGNORE:+--fp8-ignore $FP8_IGNORE} 2>&1 | tee "$OUT/fp8_sync.log" | tail -30
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || { echo "FAIL fp8_sync (rc $rc); engine log:"; tail -20 "$OUT"/run/engines/*.log; }
exit "$rc"
