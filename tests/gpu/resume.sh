#!/usr/bin/env bash
# Checkpoint + restart on GPUs (NCCL, Transformer Engine when installed): RL steps after a megatron
# dist_checkpointing save and a fresh process's load against an uninterrupted run, with a second
# uninterrupted run as the control (GPU kernels need not be deterministic: when the control differs, the
# resumed run is compared to the control's spread instead of bit for bit).
#   bash tests/gpu/resume.sh [OUT_DIR] [PARALLEL] [MODEL_DTYPE]     (defaults runs/gpu_resume ep2 bf16)
#   NPROC=1 bash tests/gpu/resume.sh OUT tp1 bf16                   (one GPU)
set -uo pipefail
OUT=${1:-runs/gpu_resume}; PAR=${2:-ep2}; DT=${3:-bf16}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 NVTE_ALLOW_NONDETERMINISTIC_ALGO=0
M=/tmp/mrl_models/tiny_gpu
[ -f $M/config.json ] || python3 -m mrl make-tiny-model $M --preset tiny_gpu >/dev/null || exit 1
run() {  # name args...
  local name=$1; shift
  python3 -m torch.distributed.run --standalone --nproc-per-node="${NPROC:-2}" -m tests.jobs.resume_check --hf $M \
    --parallel "$PAR" --dtype "$DT" --steps 4 "$@" --out "$OUT/$name" > "$OUT/$name.log" 2>&1 \
    || { echo "FAIL $name"; tail -20 "$OUT/$name.log"; exit 1; }
}
rm -rf "$OUT/ck"
run a
run control
run b1 --stop-after 2 --ckpt "$OUT/ck"
run b2 --resume "$OUT/ck"
python3 -m tests.jobs.resume_check compare "$OUT" | tee "$OUT/resume.json"
