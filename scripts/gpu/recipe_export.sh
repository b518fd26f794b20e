#!/usr/bin/env bash
# On a one-GPU host with the stack installed (install_stack.sh): issue 55's GPU runs, one after the other,
# meant to run detached (setsid) while short calls read WORK/status and collect DEST's files.
#   1. the countdown recipe (bench/recipe_run.py) on model=small_gpu, engine and trainer sharing the GPU
#      (CUDA IPC weight sync), Keep Routing on and off side by side, RECIPE_SEEDS seeds (default 1);
#   2. bench/export_time.py on the Qwen3-30B-A3B slice (EXPORT_ARGS, default 12 layers).
#   scripts/gpu/recipe_export.sh STACK WORK DEST
set -uo pipefail
source "$(dirname "$0")/prologue.sh" "$@"

say "recipe start"
# shellcheck disable=SC2086
timeout "${RECIPE_TIMEOUT:-900}" python3 bench/recipe_run.py --recipe countdown --seeds ${RECIPE_SEEDS:-1} \
  --parallel 2 --stagger "${RECIPE_STAGGER:-100}" --keep "$WORK/recipe" --out "$DEST/recipe_countdown_gpu.json" \
  --set model=small_gpu engine=gpu model.dtype=bf16 weight_sync.transport=tensor engine.base_gpu_id=0 \
        engine.mem_fraction_static=0.25 ${RECIPE_ARGS:-} \
  --variant replay_on:train.replay=true --variant replay_off:train.replay=false > "$DEST/recipe.log" 2>&1
say "recipe rc $?"
for f in "$WORK"/recipe/*.log; do tail -c 20000 "$f" > "$DEST/$(basename "$f")"; done

say "export start"
# shellcheck disable=SC2086
timeout "${EXPORT_TIMEOUT:-900}" python3 bench/export_time.py --out "$WORK/export" \
  ${EXPORT_ARGS:---shape qwen3_30b_a3b --layers 12 --optimizer-states fp32} > "$DEST/export.log" 2>&1
say "export rc $?"
cp "$WORK"/export/*.json "$DEST/" 2>/dev/null
say "done"
