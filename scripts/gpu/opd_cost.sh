#!/usr/bin/env bash
# On a one-GPU host with the stack installed (install_stack.sh): issue 57's cost of on-policy distillation
# (bench/opd_cost.py), meant to run detached (setsid) while short calls read DEST/status and collect DEST's files.
#   engines: one student and one teacher engine of model=small_gpu on the GPU, the teacher's prefill tokens/s
#            against the student's rollout tokens/s (PROMPTS x N samples of NEW tokens, ENGINE_ROUNDS rounds);
#   loop:    mrl train with scoring=opd (a teacher engine of equal size, the student's checkpoint, on the same
#            GPU) over without, in turns: ROUNDS pairs of STEPS steps, WINDOWS windows each (ROUNDS x WINDOWS
#            paired ratios of trained tokens/s; 2 x 4 = 8 by default).
#   scripts/gpu/opd_cost.sh STACK WORK DEST
set -uo pipefail
source "$(dirname "$0")/prologue.sh" "$@"

say "opd_cost start"
# shellcheck disable=SC2086
timeout "${OPD_COST_TIMEOUT:-1500}" python3 bench/opd_cost.py --keep "$WORK/opd_cost" --out "$DEST/opd_cost_gpu.json" \
  --set model=small_gpu engine=gpu model.dtype=bf16 weight_sync.transport=tensor engine.base_gpu_id=0 \
        engine.mem_fraction_static=0.25 engine.max_running_requests=128 rollout.max_new_tokens="${NEW:-1024}" \
        train.prompts_per_step=16 ${OPD_COST_SET:-} \
  --teacher-set scoring.teacher.engine.cpu_mode=false scoring.teacher.engine.cpu_threads=null \
        scoring.teacher.engine.base_gpu_id=0 scoring.teacher.engine.mem_fraction_static=0.2 \
        scoring.teacher.engine.max_running_requests=128 \
  --prompts "${PROMPTS:-64}" --n "${N:-8}" --prompt-len "${PROMPT_LEN:-256}" --new "${NEW:-1024}" \
  --engine-rounds "${ENGINE_ROUNDS:-4}" --steps "${STEPS:-40}" --skip 3 --windows "${WINDOWS:-4}" \
  --rounds "${ROUNDS:-2}" > "$DEST/opd_cost.log" 2>&1
say "opd_cost rc $?"
for f in "$WORK"/opd_cost/*.log "$WORK"/opd_cost/engines/*.log; do
  [ -f "$f" ] && tail -c 20000 "$f" > "$DEST/$(basename "$f")"
done
say "done"
