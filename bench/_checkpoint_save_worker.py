"""torchrun worker of bench/checkpoint_save.py: one RL step, then one timed ``Policy.save`` with this
rank's resident memory sampled while it runs. ``--async-save``: the save is scheduled (``save_s``: what
the training loop waits for) and then completed (``written_s``: until every rank's writer is done)."""

import argparse
import json
import os
import threading
import time

import psutil

from mrl.config.schema import Config, ModelConfig, ParallelConfig, TrainConfig
from mrl.megatron.parallel import destroy, init_parallel
from mrl.megatron.policy import Policy
from mrl.trainer.async_save import AsyncCheckpoints
from mrl.trainer.state import LoopState, tree_bytes
from tests.jobs.resume_check import synthetic_batch

ap = argparse.ArgumentParser()
ap.add_argument("--hf", required=True)
ap.add_argument("--format", required=True)
ap.add_argument("--ckpt", required=True)
ap.add_argument("--out", required=True)
ap.add_argument("--async-save", action="store_true")
a = ap.parse_args()

world = int(os.environ.get("WORLD_SIZE", "1"))
pcfg = ParallelConfig(world_size=world, ep=world)
cfg = Config(model=ModelConfig(hf_path=a.hf, make_tiny_if_missing=False), parallel=pcfg,
             train=TrainConfig(micro_batch_size=4, optimizer_checkpoint=a.format))
layout = init_parallel(pcfg, seed=cfg.seed)
policy = Policy(cfg, layout, a.hf)
c = policy.codec
policy.rl_step(synthetic_batch(0, 8, policy.bridge.vocab_size, len(c.moe_layers), c.top_k, c.num_experts), 40.0)

proc, peak, stop = psutil.Process(), [0], threading.Event()


def sample() -> None:
    while not stop.wait(0.005):
        peak[0] = max(peak[0], proc.memory_info().rss)


base = proc.memory_info().rss
t = threading.Thread(target=sample, daemon=True)
t.start()
t0 = time.perf_counter()
written_s = None
if a.async_save:
    saves = AsyncCheckpoints(lambda path, state: None)
    saves.schedule(policy.save(a.ckpt, async_save=True), a.ckpt, LoopState(step=1, version=0), began=t0)
    save_s = time.perf_counter() - t0
    saves.finalize(blocking=True)
    written_s = time.perf_counter() - t0
else:
    policy.save(a.ckpt)
    save_s = time.perf_counter() - t0
stop.set()
t.join()
size = tree_bytes(a.ckpt)
with open(f"{a.out}.rank{layout.world_rank}", "w") as f:
    json.dump({"format": a.format, "async": a.async_save, "written_s": written_s, "rank": layout.world_rank,
               "save_s": save_s, "rss_before_gib": base / 2**30,
               "peak_extra_gib": max(peak[0] - base, 0) / 2**30, "checkpoint_gib": size / 2**30,
               "params_this_rank": sum(p.numel() for p in policy.module.parameters())}, f)
destroy()
