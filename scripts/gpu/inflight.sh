#!/usr/bin/env bash
# On a one-GPU host with the stack installed (install_stack.sh): issue 58's in-flight weight-update runs, meant
# to run detached (setsid) while short calls read DEST/status and collect DEST's files. About 5 minutes.
#   1. bench/weight_sync_inflight.py: the generation pause per sync with weight_sync.pause_mode=in_place,
#      retract and staged against abort (paired, INFLIGHT_REPS repetitions, default 8), on the Qwen3-30B-A3B
#      12-layer slice (INFLIGHT_MODEL), engine beside the trainer on the one GPU (CUDA IPC) -> inplace_pause_ms,
#      staged_pause_ms (the engine log's "mrl: staged weight update" lines: each staged load's seconds and the
#      forward passes run meanwhile). Staged holds a second copy of the engine's weights outside its
#      mem_fraction_static: if the engine runs out of memory at the first staged sync, lower it (INFLIGHT_ARGS=
#      "--mem-fraction 0.35");
#   2. with LOOP=1 only (does not fit the 6 minutes): bench/loop_e2e.py on the same GPU, abort then in_place
#      (LOOP_ARGS), for inplace_vs_abort_loop.
#   scripts/gpu/inflight.sh STACK WORK DEST
set -uo pipefail
source "$(dirname "$0")/prologue.sh" "$@"

say "pause start"
# shellcheck disable=SC2086
timeout "${INFLIGHT_TIMEOUT:-330}" python3 bench/weight_sync_inflight.py --out "$WORK/inflight" \
  --model "${INFLIGHT_MODEL:-qwen3_30b_a3b_l12}" --reps "${INFLIGHT_REPS:-8}" --requests "${INFLIGHT_REQUESTS:-32}" \
  --report "$DEST/weight_sync_inflight.json" ${INFLIGHT_ARGS:-} > "$DEST/inflight.log" 2>&1
say "pause rc $?"
tail -c 20000 "$WORK/inflight/engines/inflight.log" > "$DEST/engine.log" 2>/dev/null

if [ "${LOOP:-0}" = 1 ]; then
  for mode in abort in_place; do
    say "loop $mode start"
    # shellcheck disable=SC2086
    timeout "${LOOP_TIMEOUT:-900}" python3 bench/loop_e2e.py --out "$WORK/loop_$mode" --gpus 0 --skip-ceilings \
      --set weight_sync.pause_mode=$mode weight_sync.transport=tensor engine.base_gpu_id=0 \
            engine.mem_fraction_static=0.4 ${LOOP_ARGS:-} > "$DEST/loop_$mode.log" 2>&1
    say "loop $mode rc $?"
    cp "$WORK/loop_$mode"/*.json "$DEST/" 2>/dev/null
  done
fi
say "done"
