"""How a trainer checkpoint lays out the optimizer state (megatron's DistributedOptimizer sharding types),
recorded beside it so that a resume reads it the way it was written, whatever the current config says.

- ``dp_reshardable``: each rank writes its own shard of the optimizer's flat buffers; no gather, no copy,
  every rank writes at once. A resume needs the same model-parallel layout (TP, PP, EP, expert TP, CP);
  the DP size may change.
- ``fully_reshardable``: any layout can resume. Saving gathers each model-parallel group's whole fp32
  state (master weights and both Adam moments, 12 bytes per parameter of the group, whatever
  ``train.optimizer_states_dtype`` is) over gloo into host memory on its DP rank 0, through per-bucket
  exchange buffers, and the checkpoint writer then copies every parameter's slice of it once more: that
  rank holds the state several times over while it saves.
"""

from __future__ import annotations

import json
import os

from mrl.config.train import OPTIMIZER_CHECKPOINT_FORMATS as FORMATS
from mrl.models.checkpoint import CheckpointError

RECORD = "optimizer_format.json"
LEGACY = "fully_reshardable"  # checkpoints written before the record carry this layout
_MODEL_PARALLEL = ("tp", "pp", "ep", "etp", "cp", "pp_first_layers", "pp_last_layers")


def metadata(fmt: str) -> dict:
    """``metadata`` for megatron's ``sharded_state_dict`` calls (model and optimizer)."""
    if fmt not in FORMATS:
        raise ValueError(f"optimizer checkpoint format {fmt!r}: expected one of {FORMATS}")
    meta = {"distrib_optim_sharding_type": fmt, "chained_optim_avoid_prefix": True}
    if fmt == "fully_reshardable":  # gather on the host over gloo, not through an NCCL all-gather on every GPU
        meta["distrib_optim_fully_reshardable_mem_efficient"] = True
    return meta


def layout_record(parallel) -> dict:
    """The model-parallel layout a dp_reshardable checkpoint is bound to (``parallel``: ParallelConfig): the
    sizes and the pipeline's layer split, which decide each rank's optimizer buffers."""
    return {"tp": parallel.tp, "pp": parallel.pp, "ep": parallel.ep, "etp": parallel.etp or parallel.tp,
            "cp": parallel.cp, "pp_first_layers": parallel.pp_first_layers, "pp_last_layers": parallel.pp_last_layers}


def write_record(path: str, fmt: str, parallel, world_size: int) -> None:
    with open(os.path.join(path, RECORD), "w") as f:
        json.dump({"format": fmt, "layout": layout_record(parallel), "world_size": world_size}, f)


def read_format(path: str, parallel) -> str:
    """The checkpoint's optimizer format; CheckpointError when this run's layout cannot read it."""
    rec_path = os.path.join(path, RECORD)
    if not os.path.exists(rec_path):
        return LEGACY
    with open(rec_path) as f:
        rec = json.load(f)
    fmt = rec.get("format")
    if fmt not in FORMATS:
        raise CheckpointError(f"{rec_path}: optimizer format {fmt!r} is none of {FORMATS}")
    saved, now = rec.get("layout", {}), layout_record(parallel)
    if fmt == "dp_reshardable" and any(saved.get(k) != now[k] for k in _MODEL_PARALLEL):
        differ = ", ".join(f"{k} {saved.get(k)} -> {now[k]}" for k in _MODEL_PARALLEL if saved.get(k) != now[k])
        raise CheckpointError(
            f"{path}: its optimizer state was saved with train.optimizer_checkpoint=dp_reshardable, which resumes "
            f"only in the layout it was written in ({differ}): resume with parallel as saved ({saved}), or have "
            "the run that writes the checkpoint save it with train.optimizer_checkpoint=fully_reshardable")
    return fmt
