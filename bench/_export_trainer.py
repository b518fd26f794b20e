"""torchrun worker of bench/export_time.py: a trainer that loads an HF checkpoint into ``Policy`` and writes a
trainer checkpoint as ``mrl train`` does, with no training step between (the weights must come back out of
``mrl export`` bit for bit).

    torchrun --nproc-per-node 1 bench/_export_trainer.py --hf DIR --run-dir RUN --dtype bf16 --out R.json

Leaves what ``mrl export`` reads: ``RUN/config.yaml`` (the resolved config, as the launcher writes it) and
``RUN/checkpoints/step_0``, written by the loop's synchronous save (``Policy.save``, then the loop state last,
which marks it complete). ``--optimizer-state adam``: Adam's states exist as after a run's first step
(megatron's ``_init_optimizer_states_with_dummy_values``: zero moments, the weights unchanged), so the checkpoint
holds what a real run's does; ``none``: the same save with the optimizer's part left out (the model's sharded
state only), for a slice whose Adam states do not fit the GPU; ``mrl export`` reads the model's part only.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from mrl.config.load import compose
from mrl.megatron import compat
from mrl.megatron.parallel import destroy, init_parallel
from mrl.megatron.policy import Policy
from mrl.trainer.state import LoopState, tree_bytes, write_loop_state

ap = argparse.ArgumentParser()
ap.add_argument("--hf", required=True)
ap.add_argument("--run-dir", required=True)
ap.add_argument("--dtype", choices=["bf16", "fp32"], required=True)
ap.add_argument("--optimizer-states", choices=["bf16", "fp32"], default="fp32", help="train.optimizer_states_dtype")
ap.add_argument("--optimizer-state", choices=["adam", "none"], default="adam")
ap.add_argument("--parallel", default="tp1", help="a conf/parallel preset")
ap.add_argument("--out", required=True)
a = ap.parse_args()

t0 = time.perf_counter()
run = os.path.abspath(a.run_dir)
cfg = compose([f"model.hf_path={os.path.abspath(a.hf)}", "model.make_tiny_if_missing=false", f"model.dtype={a.dtype}",
               f"train.optimizer_states_dtype={a.optimizer_states}", f"parallel={a.parallel}", f"run_dir={run}"])
layout = init_parallel(cfg.parallel, seed=cfg.seed)
policy = Policy(cfg, layout, cfg.model.hf_path)
if compat.HAS_CUDA:
    torch.cuda.synchronize()
load_s = time.perf_counter() - t0

if a.optimizer_state == "adam":
    for opt in getattr(policy.optimizer, "chained_optimizers", [policy.optimizer]):
        opt._init_optimizer_states_with_dummy_values()
else:  # the loop's save, its optimizer part left out
    policy._sharded = lambda is_loading, fmt: {"model": policy._model_sharded(fmt)}
peak_before_save = torch.cuda.max_memory_allocated() if compat.HAS_CUDA else 0

path = os.path.join(run, "checkpoints", "step_0")
t1 = time.perf_counter()
policy.save(path)
dist.barrier()
if layout.world_rank == 0:  # as the loop's controller: the loop state last, marking the checkpoint complete
    write_loop_state(path, LoopState(step=0, version=0))
    with open(os.path.join(run, "config.yaml"), "w") as f:
        f.write(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
dist.barrier()
save_s = time.perf_counter() - t1

if layout.world_rank == 0:
    with open(a.out, "w") as f:
        json.dump({"world_size": layout.world_size, "parallel": a.parallel, "dtype": a.dtype,
                   "optimizer_states_dtype": a.optimizer_states, "optimizer_state": a.optimizer_state,
                   "load_s": load_s, "save_s": save_s, "checkpoint": path, "checkpoint_bytes": tree_bytes(path),
                   "params_rank0": sum(p.numel() for p in policy.module.parameters()),
                   "peak_gpu_gib_before_save": peak_before_save / 2**30,
                   "peak_gpu_gib": (torch.cuda.max_memory_allocated() / 2**30) if compat.HAS_CUDA else None}, f)
destroy()
