#!/usr/bin/env bash
# GPU weight-sync benchmark (NCCL): Megatron ranks -> receivers following SGLang's protocol, >= 1 GiB bf16 model.
# Needs 4 GPUs (2 trainer + 2 receivers). Carry .whl/ (megatron-core, httpx, aiohttp and their deps).
#   bash tests/gpu/weight_sync_bench.sh [OUT_DIR]
set -uo pipefail
OUT=${1:-${OUT:-runs/gpu_sync_bench}}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
python3 bench/weight_sync_bench.py --scale gpu --receivers 2 --layouts tp1 tp2 ep2 tp2ep2 --reps 3 2>&1 | tee "$OUT/bench.txt"
