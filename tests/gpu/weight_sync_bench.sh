#!/usr/bin/env bash
# GPU weight-sync benchmark (NCCL): Megatron ranks -> receivers following SGLang's protocol, >= 1 GiB bf16 model.
# 4 GPUs: every layout, 2 receivers. 2 GPUs: 1 receiver; tp1 (receiver on GPU 1) and tp2 (receiver on GPU 1,
# beside trainer rank 1, which never broadcasts); layouts with two senders need 3+ GPUs and are skipped.
# Carry .whl/ (megatron-core, httpx, aiohttp and their deps).
#   bash tests/gpu/weight_sync_bench.sh [OUT_DIR]     -> OUT_DIR/{gpus.txt,weight_sync.txt,weight_sync.json,nccl_transport.txt}
# Env: LAYOUTS, BUCKETS (MiB), REPS, RECEIVERS, LAYOUT_TIMEOUT (s, default 150: past it every worker and
# receiver dumps its stacks into weight_sync.txt and the next layout runs).
set -uo pipefail
OUT=${1:-${OUT:-runs/gpu_sync_bench}}
mkdir -p "$OUT"
if ! python3 -c "import megatron.core, httpx, aiohttp" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
# NCCL's transport choice per channel (P2P / SHM / NET) goes to a summary: it decides the GiB/s
NCCL_LOGS=$(mktemp -d)
export NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT NCCL_DEBUG_FILE=$NCCL_LOGS/%h.%p.log
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpus.txt"
nvidia-smi topo -m >> "$OUT/gpus.txt" 2>&1
NGPU=$(nvidia-smi -L | wc -l)
if [ "$NGPU" -ge 4 ]; then DEF_RECV=2; DEF_LAYOUTS="tp1 tp2 ep2 tp2ep2 pp2"; else DEF_RECV=1; DEF_LAYOUTS="tp1 tp2"; fi
python3 bench/weight_sync_bench.py --scale gpu --receivers ${RECEIVERS:-$DEF_RECV} --layouts ${LAYOUTS:-$DEF_LAYOUTS} \
  --bucket-mb ${BUCKETS:-256 1024} --reps ${REPS:-5} --timeout ${LAYOUT_TIMEOUT:-150} \
  --json "$OUT/weight_sync.json" 2>&1 | tee "$OUT/weight_sync.txt"
rc=${PIPESTATUS[0]}
cat "$NCCL_LOGS"/*.log 2>/dev/null | grep -oE "(via [A-Za-z0-9/_]+|NCCL version [0-9.+a-z]+)" | sort | uniq -c \
  > "$OUT/nccl_transport.txt"
cat "$OUT/nccl_transport.txt"
exit $rc
