#!/bin/bash
# mrl node entry: one srun task per node, started by mrl.sbatch (inside the container when there is one).
#
#   bash mrl_node.sh engine   # `mrl engine`: ENGINES_PER_NODE SGLang servers, each announced as
#                             #   $RUN_DIR/engines/<host>-engine<i>.url once healthy
#   bash mrl_node.sh scoring POOL     # `mrl engine --pool POOL`: this node's share of scoring.POOL's servers,
#                             #   each announced as $RUN_DIR/engines/POOL/<host>-POOL<i>.url once healthy
#   bash mrl_node.sh train    # `mrl train` on this node; torchrun reads its multi-node flags from PET_*
#
# Both load $RUN_DIR/job.yaml, i.e. the config composed once by `mrl launch` (config.yaml), so every node
# runs exactly that config. With engine nodes (NUM_ROLLOUT_NODES > 0) the trainer attaches to the announced
# engines (engine.url_dir); without, it starts its own engines as a local run does. So for each scoring pool
# of SCORING_POOLS ("pool:nodes:engines_per_node ..."): the rollout process attaches to its announced servers.
set -euo pipefail
role=${1:?usage: mrl_node.sh engine|train}
: "${RUN_DIR:?RUN_DIR must be set (mrl.sbatch exports it)}"
PY=${MRL_PYTHON:-python}
JOB=(--config-path "$RUN_DIR" --config-name job)
ATTACH=()
(( ${NUM_ROLLOUT_NODES:-0} > 0 )) && ATTACH=(engine.url_dir="$RUN_DIR/engines")
for entry in ${SCORING_POOLS:-}; do
  ATTACH+=("scoring.${entry%%:*}.engine.url_dir=$RUN_DIR/engines/${entry%%:*}")
done
echo "[mrl-node ${SLURMD_NODENAME:-$HOSTNAME}] role $role, task ${SLURM_PROCID:-0} of ${SLURM_NTASKS:-1}"

case $role in
  engine)
    [[ -n ${MRL_ENGINE_CMD:-} ]] && exec bash -c "$MRL_ENGINE_CMD"
    exec "$PY" -m mrl engine "${JOB[@]}" "${ATTACH[@]}" engine.count="${ENGINES_PER_NODE:-1}"
    ;;
  scoring)
    export MRL_POOL=${2:?usage: mrl_node.sh scoring POOL}
    [[ -n ${MRL_SCORING_CMD:-} ]] && exec bash -c "$MRL_SCORING_CMD"
    exec "$PY" -m mrl engine --pool "$MRL_POOL" "${JOB[@]}" "${ATTACH[@]}"
    ;;
  train)
    # torchrun takes any flag it is not given from PET_<FLAG>: static rendezvous on the first trainer node,
    # node rank = this task's rank in the trainer step (one task per node).
    export PET_NNODES=${NUM_TRAIN_NODES:-1} PET_NODE_RANK=${SLURM_PROCID:-0}
    export PET_NPROC_PER_NODE=${NPROC_PER_NODE:-1}
    export PET_MASTER_ADDR=${MASTER_ADDR:-127.0.0.1} PET_MASTER_PORT=${MASTER_PORT:-29500}
    [[ -n ${MRL_TRAIN_CMD:-} ]] && exec bash -c "$MRL_TRAIN_CMD"
    exec "$PY" -m mrl train "${JOB[@]}" "${ATTACH[@]}"
    ;;
  *)
    echo "mrl_node.sh: unknown role '$role' (engine, scoring or train)" >&2
    exit 2
    ;;
esac
