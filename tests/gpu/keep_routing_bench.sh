#!/usr/bin/env bash
# Keep Routing and RL-step benchmarks on GPUs (NCCL, bf16), on the 490M Qwen3-MoE bench shape (bench/_bench_common.py)
# (hidden 1024, 8 layers, 64 experts top-8, transformers' random init), generated once:
#   1. routing_mismatch: transformers vs Megatron routing / logprobs, without and with replay (1 GPU)
#   2. replay_overhead:  fwd+bwd step time with replay on / off, TP2(SP) and EP2 (2 GPUs)
#   3. rl_step_vs_bare:  Policy.rl_step tokens/s vs bare megatron fwd/bwd, TP2(SP) and EP2 (2 GPUs)
# Carry .whl/ (megatron-core wheel). Uses GPUs 0 and 1 of however many there are.
#   bash tests/gpu/keep_routing_bench.sh [OUT_DIR]
#   BENCHES="replay_overhead" ARGS_replay_overhead="--reps 16 --profile" bash tests/gpu/keep_routing_bench.sh
set -uo pipefail
OUT=${1:-${OUT:-runs/gpu_keep_routing}}
mkdir -p "$OUT"
if ! python3 -c "import megatron.core" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpus_keep_routing.txt"
python3 -c "import torch, transformers, megatron.core as m; print('torch', torch.__version__, 'transformers', transformers.__version__, 'megatron-core', m.__version__)" | tee -a "$OUT/gpus_keep_routing.txt"
M=/tmp/mrl_bench_models/gpu
python3 bench/_bench_common.py make-model $M --preset gpu || exit 1
fails=0
for b in ${BENCHES:-routing_mismatch replay_overhead rl_step_vs_bare}; do
  echo "== $b" | tee -a "$OUT/keep_routing.txt"
  extra=ARGS_$b  # e.g. ARGS_replay_overhead="--reps 16"
  python3 bench/$b.py --scale gpu --hf $M --json "$OUT/$b.json" ${!extra:-} 2>&1 | grep -v "^{" | tee -a "$OUT/keep_routing.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || { fails=$((fails+1)); echo "FAIL $b" | tee -a "$OUT/keep_routing.txt"; }
done
echo "failures: $fails"
exit $fails
