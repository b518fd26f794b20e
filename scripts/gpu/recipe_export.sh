#!/usr/bin/env bash
# On a one-GPU host with the stack installed (install_stack.sh): issue 55's GPU runs, one after the other,
# meant to run detached (setsid) while short calls read WORK/status and collect DEST's files.
#   1. the countdown recipe (bench/recipe_run.py) on model=small_gpu, engine and trainer sharing the GPU
#      (CUDA IPC weight sync), Keep Routing on and off side by side, RECIPE_SEEDS seeds (default 1);
#   2. bench/export_time.py on the Qwen3-30B-A3B slice (EXPORT_ARGS, default 12 layers);
#   3. with EVAL=1 only: what evaluation beside training costs the steps (bench/default_run_ab.py): the default
#      task on model=tiny_gpu, engine beside the trainer, evaluation off (A) and every 5 steps with sampled
#      pass@1/4/8 (B), EVAL_ROUNDS pairs (default 8) of EVAL_STEPS steps (default 30); about 16 engine starts.
#   RECIPE=0 / EXPORT=0 skip the first two.
#   scripts/gpu/recipe_export.sh STACK WORK DEST
set -uo pipefail
source "$(dirname "$0")/prologue.sh" "$@"

if [ "${RECIPE:-1}" = 1 ]; then
  say "recipe start"
  # shellcheck disable=SC2086
  timeout "${RECIPE_TIMEOUT:-900}" python3 bench/recipe_run.py --recipe countdown --seeds ${RECIPE_SEEDS:-1} \
    --parallel 2 --stagger "${RECIPE_STAGGER:-100}" --keep "$WORK/recipe" --out "$DEST/recipe_countdown_gpu.json" \
    --set model=small_gpu engine=gpu model.dtype=bf16 weight_sync.transport=tensor engine.base_gpu_id=0 \
          engine.mem_fraction_static=0.25 ${RECIPE_ARGS:-} \
    --variant replay_on:train.replay=true --variant replay_off:train.replay=false > "$DEST/recipe.log" 2>&1
  say "recipe rc $?"
  for f in "$WORK"/recipe/*.log; do tail -c 20000 "$f" > "$DEST/$(basename "$f")"; done
fi

if [ "${EXPORT:-1}" = 1 ]; then
  say "export start"
  # shellcheck disable=SC2086
  timeout "${EXPORT_TIMEOUT:-900}" python3 bench/export_time.py --out "$WORK/export" \
    ${EXPORT_ARGS:---shape qwen3_30b_a3b --layers 12 --optimizer-states fp32} > "$DEST/export.log" 2>&1
  say "export rc $?"
  cp "$WORK"/export/*.json "$DEST/" 2>/dev/null
fi

if [ "${EVAL:-0}" = 1 ]; then
  say "eval overhead start"
  timeout "${EVAL_TIMEOUT:-1800}" python3 bench/default_run_ab.py --steps "${EVAL_STEPS:-30}" \
    --rounds "${EVAL_ROUNDS:-8}" --name eval_overhead_gpu --out "$DEST/eval_overhead_gpu.json" \
    --set "model=tiny_gpu engine=gpu model.dtype=bf16 weight_sync.transport=tensor engine.base_gpu_id=0 \
           engine.mem_fraction_static=0.3 ${EVAL_SET:-}" \
    --a train.eval_every=0 --b 'train.eval_every=5 train.eval_sets.0.n=8 train.eval_sets.0.k=[1,4,8]' \
    > "$DEST/eval_overhead.log" 2>&1
  say "eval overhead rc $?"
fi
say "done"
