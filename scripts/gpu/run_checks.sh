#!/usr/bin/env bash
# On a GPU host with the stack installed (install_stack.sh): mrl's GPU checks, each job on its own GPUs, side by
# side. Every job logs to WORK/<job>.log; results (JSON, PNG, summaries, logs; no checkpoints) are packed into
# DEST/gpu_checks.tgz at the end.
#   scripts/gpu/run_checks.sh STACK WORK DEST JOB=GPUS[,te] ...      e.g. learn=0,1,te loop=2,3 parity=0,1,te
# Jobs:
#   learn   mrl train (GRPO, model=tiny_gpu, bf16) with the trainer on the first GPU and a GPU engine on the
#           second, weights synced into the live engine every step over NCCL (LEARN_ARGS: more overrides; one
#           GPU shared by both needs a transport that can share it: weight_sync.transport=tensor (CUDA IPC)
#           rollout.base_gpu_id=0 rollout.mem_fraction_static=0.3)
#   speed   bench/rl_step_vs_megatron.py once per ';'-separated argument list in SPEED_RUNS
#   loop    bench/gpu_loop.py: rollout throughput routes on/off, Keep Routing replay off/on, sync vs raw NCCL
#   loop30b bench/gpu_loop.py on a 4-layer Qwen3-30B-A3B slice: Keep Routing replay off/on
#   loops   bench/gpu_loop.py once per ';'-separated argument list in LOOP_RUNS, one after another (GPU
#           indices in the arguments count within the job's GPUs), e.g. the sync with and without
#           --load-weights, the rollouts with and without --routes-int32
#   parity  tests/gpu/parity.sh: the megatron model vs transformers per layout (TE spec when "te" is given)
#   resume  tests/gpu/resume.sh: RL steps after a dist_checkpointing save and a restart against an uninterrupted
#           run and a control run (RESUME_ARGS: parallel preset and model dtype, default "ep2 bf16")
# ",te" puts Transformer Engine on the job's path (megatron's TE spec); without it the local spec runs.
set -uo pipefail
STACK=${1:?stack}; WORK=${2:?work dir}; DEST=${3:?dest}; shift 3
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$WORK" "$DEST"
export PYTHONUNBUFFERED=1 TIMEOUT=${TIMEOUT:-560}
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader > "$WORK/gpus.txt"

job() {  # name gpus te
  local name=$1 gpus=$2 te=$3 n
  n=$(echo "$gpus" | tr ',' '\n' | wc -l)
  (
    cd "$ROOT"
    # shellcheck disable=SC1091
    source "$STACK/env.sh" $te
    export PYTHONPATH=$ROOT:$PYTHONPATH CUDA_VISIBLE_DEVICES=$gpus
    case $name in
      learn) timeout "$TIMEOUT" python3 -m mrl train model=tiny_gpu rollout=gpu "model.dtype=${LEARN_DTYPE:-bf16}" \
               "run_dir=$WORK/learn" train.steps="${LEARN_STEPS:-120}" ${LEARN_ARGS:-} ;;
      speed) i=0; IFS=';' read -ra runs <<< "${SPEED_RUNS:---shape bench490}"
             for args in "${runs[@]}"; do i=$((i + 1))
               # shellcheck disable=SC2086
               (cd bench && timeout "$TIMEOUT" python3 rl_step_vs_megatron.py $args --json "$WORK/speed_$i.json") \
                 || echo "speed run $i ($args) failed: $?"
             done ;;
      loop) timeout "$TIMEOUT" python3 bench/gpu_loop.py --engine-gpu $((n - 1)) --trainer-gpus 0 --out "$WORK/loop" \
              ${LOOP_ARGS:-} ;;
      loops) i=0; IFS=';' read -ra runs <<< "${LOOP_RUNS:?LOOP_RUNS}"
             for args in "${runs[@]}"; do i=$((i + 1))
               # shellcheck disable=SC2086
               timeout "$TIMEOUT" python3 bench/gpu_loop.py $args --out "$WORK/loops_$i" || echo "loop run $i ($args) failed: $?"
             done ;;
      loop30b) timeout "$TIMEOUT" python3 bench/gpu_loop.py --model qwen3_30b_a3b --layers 4 --sections replay \
                 --engine-gpu $((n - 1)) --trainer-gpus 0 --out "$WORK/loop30b" ;;
      parity) timeout "$TIMEOUT" bash tests/gpu/parity.sh "$WORK/parity" ;;
      # shellcheck disable=SC2086
      resume) timeout "$TIMEOUT" bash tests/gpu/resume.sh "$WORK/resume" ${RESUME_ARGS:-ep2 bf16} ;;
      *) echo "unknown job $name"; exit 2 ;;
    esac
  ) > "$WORK/$name.log" 2>&1
  echo $? > "$WORK/$name.rc"
}

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
