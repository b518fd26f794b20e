#!/bin/bash
# Stand-in for `mrl train` in the preemption test (MRL_TRAIN_CMD): the trainer's contract on USR1 is
# "finish the step, write a checkpoint into $RUN_DIR/checkpoints, exit 0"; on restart it resumes.
attempt=${SLURM_RESTART_COUNT:-0}
echo "stand-in trainer: attempt $attempt, node rank ${PET_NODE_RANK:-?} of ${PET_NNODES:-?}, master ${PET_MASTER_ADDR:-?}:${PET_MASTER_PORT:-?}"
mkdir -p "$RUN_DIR/checkpoints"
if [[ -f $RUN_DIR/checkpoints/step_3 ]]; then
  echo "stand-in trainer: resumed from checkpoint step_3"
  echo "$attempt" > "$RUN_DIR/resumed_attempt"
  exit 0
fi
got=0
trap 'got=1' USR1
touch "$RUN_DIR/trainer_ready_$attempt"
for _ in $(seq 600); do
  if (( got )); then
    echo "stand-in trainer: got USR1, writing checkpoint step_3"
    touch "$RUN_DIR/checkpoints/step_3"
    exit 0
  fi
  sleep 0.1
done
echo "stand-in trainer: no USR1 within 60 s" >&2
exit 3
