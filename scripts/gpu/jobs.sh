# The GPU jobs of run_checks.sh and run_phases.sh (sourced). job NAME GPUS TE runs one job with
# CUDA_VISIBLE_DEVICES=GPUS (TE = "te": Transformer Engine on the path), logging to WORK/NAME.log and its exit
# status to WORK/NAME.rc. Needs STACK, WORK, DEST, ROOT and TIMEOUT set by the caller, which calls prepare_work first.
#   learn   mrl train (GRPO, model=tiny_gpu, bf16) with the trainer on the first GPU and a GPU engine on the
#           second, weights synced into the live engine every step over NCCL (LEARN_ARGS: more overrides; one
#           GPU shared by both needs a transport that can share it: weight_sync.transport=tensor (CUDA IPC)
#           engine.base_gpu_id=0 engine.mem_fraction_static=0.3); learn<x>: the same with LEARN_ARGS_learn<x>, in
#           WORK/learn<x>, e.g. an FP8 run beside a bf16 one on one GPU each (LEARN_ARGS_learnfp8="engine.quantization=fp8
#           weight_sync.transport=tensor engine.base_gpu_id=0 engine.mem_fraction_static=0.3")
#   speed   bench/rl_step_vs_megatron.py once per ';'-separated argument list in SPEED_RUNS
#           Issue 34's runs (2x H200, job speed=0,1,te; tp1 takes the first GPU): the Qwen3-30B-A3B 12-layer slice,
#           CUTLASS grouped GEMM, mrl's fused-router replay off then on, 8 ABBA pairs a layout (--reps 4 --rounds 1;
#           --rounds 2 gives 16 from twice the processes, about twice the time: run_phases.sh's TIMEOUT), e.g.
#             C="--shape qwen3_30b_a3b_l12 --seq 4096 --micro-batches 2 --micro-batch-size 4 --optimizer-states bf16 \
#                --grouped-gemm cutlass --reps 4 --warmup 2 --rounds 1 --model-dir /tmp/mrl-speed-models"
#             SPEED_RUNS="--layouts ep2 $C --fused-router-replay off;--layouts ep2 $C --fused-router-replay on;\
#             --layouts tp2 $C --fused-router-replay off;--layouts tp2 $C --fused-router-replay on;\
#             --layouts tp1 $C --fused-router-replay off;--layouts tp1 $C --fused-router-replay on"
#           (SPEED_RUNS must be one line: it is read with `read`). Per run, from the 2026-11-28 reports: about 45 s to start and set up
#           each of its 4 processes, the first warm-up step (megatron 11-36 s, mrl 6-9 s), then 5 steps of
#           0.9-1.5 s: ep2 and tp1 about 4.5 min, tp2 about 4 min, the first run 15.8 GB of checkpoint more.
#           Where the hosts run ahead: "--layouts ep2 $C --host-lead" (4 more steps a process, under a minute more).
#   fusedreplay tests/jobs/fused_replay_check.py: train.fused_router_replay's router with TE's kernels against
#           megatron's replay path (three router kinds, forward and recompute; seconds; one GPU, "te")
#   loop    bench/gpu_loop.py: rollout throughput routes on/off, Keep Routing replay off/on, sync vs raw NCCL
#   loop30b bench/gpu_loop.py on a 4-layer Qwen3-30B-A3B slice: Keep Routing replay off/on
#   loops*  bench/gpu_loop.py once per ';'-separated argument list in LOOP_RUNS_<name> (else LOOP_RUNS), one after
#           another (GPU indices in the arguments count within the job's GPUs), e.g. the sync with and without
#           --load-weights, the rollouts with and without --routes-int32; output in WORK/<name>_<i>/. On one GPU:
#           FP8 vs bf16 engines "--model qwen3_30b_a3b --layers 12 --engine-gpu 0 --fp8-engine-gpu 0
#           --trainer-gpus 0 --start-one-by-one --mem-fraction 0.3 --max-total-tokens 262144 --sections rollout,replay";
#           engine start variants "... --variant noprefill={"disable_prefill_cuda_graph":true}" (JSON without spaces)
#   e2e*    bench/loop_e2e.py (the whole loop, `mrl train`, against its engine and trainer ceilings) on the job's
#           GPUs, with the arguments in E2E_ARGS_<name> (e.g. E2E_ARGS_e2e4="--trainer-procs 2 --set parallel=ep2
#           engine.tp=2"); output in WORK/<name>/
#   delivery bench/batch_delivery.py: a step's batch to the trainer ranks, whole and pickled vs each DP rank's share
#   parity  tests/gpu/parity.sh: the megatron model vs transformers per layout (TE spec when "te" is given)
#   fp8quant tests/gpu/fp8_quant.sh: the block-FP8 triton kernel against the torch path, bit for bit (one GPU)
#   mismatch tests/gpu/mismatch_split.sh: the mismatch split by cause for an engine mrl launches and a plain SGLang
#           server attached by URL (MISMATCH_STEPS steps each, default 60; MISMATCH_EXTRA: more overrides)
#   fp8sync tests/gpu/fp8_sync.sh: an FP8 weight sync into an engine serving the run's block-FP8 export (2 GPUs:
#           trainer on the first, engine on the second, NCCL; one GPU: both on it, CUDA IPC), engine tensors vs
#           the trainer's quantization bit for bit
#   keeprouting tests/gpu/keep_routing_bench.sh on the 490M model: routing mismatch, Keep Routing's step overhead
#           (replay on / off, TP2+SP and EP2, the median of per-repetition ratios), rl_step against bare megatron
#           (BENCHES and ARGS_<bench> pass through, e.g. BENCHES=replay_overhead ARGS_replay_overhead="--reps 16")
#   export  bench/export_time.py: a trainer checkpoint of a random-weight model written as `mrl train` writes one,
#           then `mrl export` of it timed as a whole process (3 repetitions, cold page cache, a synced copy of
#           the same bytes as the baseline), every export checked bit for bit against the source; one GPU,
#           always with Transformer Engine (the trainer's bf16 Adam states); output in WORK/export/. EXPORT_ARGS:
#           the model (default "--shape qwen3_30b_a3b --layers 12", the 30B slice: 16.2 GB exported; on an 80 GB
#           H100 its checkpoint is saved without Adam's states, which fit up to 8 layers: the report says which)
#   resume  tests/gpu/resume.sh: RL steps after a dist_checkpointing save and a restart against an uninterrupted
#           run and a control run (RESUME_ARGS: parallel preset and model dtype, default "ep2 bf16")
prepare_work() {  # WORK made, unbuffered Python, the host's GPUs recorded
  mkdir -p "$WORK" "$DEST"
  export PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader > "$WORK/gpus.txt"
}

job() {  # name gpus te
  local name=$1 gpus=$2 te=$3 n
  n=$(echo "$gpus" | tr ',' '\n' | wc -l)
  (
    cd "$ROOT"
    case $name in export) te=te ;; esac  # its trainer keeps bf16 Adam states: TE's FusedAdam
    # shellcheck disable=SC1091
    source "$STACK/env.sh" $te
    export PYTHONPATH=$ROOT:$PYTHONPATH CUDA_VISIBLE_DEVICES=$gpus
    case $name in
      learn*) args_var="LEARN_ARGS_$name"
              # shellcheck disable=SC2086
              timeout "$TIMEOUT" python3 -m mrl train model=tiny_gpu engine=gpu "model.dtype=${LEARN_DTYPE:-bf16}" \
                "run_dir=$WORK/$name" train.steps="${LEARN_STEPS:-120}" ${!args_var:-${LEARN_ARGS:-}} ;;
      speed) i=0; IFS=';' read -ra runs <<< "${SPEED_RUNS:---shape bench490}"
             for args in "${runs[@]}"; do i=$((i + 1))
               # shellcheck disable=SC2086
               (cd bench && timeout "$TIMEOUT" python3 rl_step_vs_megatron.py $args --json "$WORK/speed_$i.json") \
                 || echo "speed run $i ($args) failed: $?"
             done ;;
      loop) timeout "$TIMEOUT" python3 bench/gpu_loop.py --engine-gpu $((n - 1)) --trainer-gpus 0 --out "$WORK/loop" \
              ${LOOP_ARGS:-} ;;
      loops*) runs_var="LOOP_RUNS_$name"; i=0; IFS=';' read -ra runs <<< "${!runs_var:-${LOOP_RUNS:?LOOP_RUNS}}"
             for args in "${runs[@]}"; do i=$((i + 1))
               # shellcheck disable=SC2086
               timeout "$TIMEOUT" python3 bench/gpu_loop.py $args --out "$WORK/${name}_$i" || echo "loop run $i ($args) failed: $?"
             done ;;
      loop30b) timeout "$TIMEOUT" python3 bench/gpu_loop.py --model qwen3_30b_a3b --layers 4 --sections replay \
                 --engine-gpu $((n - 1)) --trainer-gpus 0 --out "$WORK/loop30b" ;;
      e2e*) args_var="E2E_ARGS_$name"
            # shellcheck disable=SC2086
            timeout "$TIMEOUT" python3 bench/loop_e2e.py --out "$WORK/$name" --gpus "$gpus" ${!args_var:-} ;;
      delivery) mkdir -p "$WORK/delivery"
                 timeout "$TIMEOUT" python3 bench/batch_delivery.py --nproc "$n" --dp "$n" --reps 12 \
                   --json "$WORK/delivery/batch_delivery.json" ;;
      fusedreplay) mkdir -p "$WORK/fusedreplay"
                   timeout "$TIMEOUT" python3 -m tests.jobs.fused_replay_check --out "$WORK/fusedreplay/fused_replay.json" ;;
      mismatch) STEPS=${MISMATCH_STEPS:-60} EXTRA=${MISMATCH_EXTRA:-} TIMEOUT=$TIMEOUT \
                  bash tests/gpu/mismatch_split.sh "$WORK/mismatch" ;;
      parity) timeout "$TIMEOUT" bash tests/gpu/parity.sh "$WORK/parity" ;;
      keeprouting) timeout "$TIMEOUT" bash tests/gpu/keep_routing_bench.sh "$WORK/keeprouting" ;;
      fp8quant) timeout "$TIMEOUT" bash tests/gpu/fp8_quant.sh "$WORK/fp8quant" ;;
      fp8sync) timeout "$TIMEOUT" bash tests/gpu/fp8_sync.sh "$WORK/fp8sync" ;;
      # shellcheck disable=SC2086
      export) timeout "$TIMEOUT" python3 bench/export_time.py --out "$WORK/export" \
                ${EXPORT_ARGS:---shape qwen3_30b_a3b --layers 12} ;;
      # shellcheck disable=SC2086
      resume) timeout "$TIMEOUT" bash tests/gpu/resume.sh "$WORK/resume" ${RESUME_ARGS:-ep2 bf16} ;;
      *) echo "unknown job $name"; exit 2 ;;
    esac
  ) > "$WORK/$name.log" 2>&1
  echo $? > "$WORK/$name.rc"
}
