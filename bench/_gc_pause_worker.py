"""torchrun worker of bench/gc_pause.py: a trainer rank's heap, a full collection timed before and after
the freeze ``train.gc_freeze`` makes."""

import argparse
import gc
import json
import statistics
import time

from mrl.config.schema import Config, ModelConfig, ParallelConfig, TrainConfig
from mrl.megatron.collector import StepCollector
from mrl.megatron.parallel import destroy, init_parallel
from mrl.megatron.policy import Policy
from tests.jobs.resume_check import synthetic_batch

ap = argparse.ArgumentParser()
ap.add_argument("--hf", required=True)
ap.add_argument("--reps", type=int, default=7)
ap.add_argument("--out", required=True)
a = ap.parse_args()

pcfg = ParallelConfig(world_size=1)
# the trainer's own freeze is off here: this worker times the heap before and after it
cfg = Config(model=ModelConfig(hf_path=a.hf, make_tiny_if_missing=False), parallel=pcfg,
             train=TrainConfig(micro_batch_size=4, gc_freeze=False))
layout = init_parallel(pcfg, seed=cfg.seed)
policy = Policy(cfg, layout, a.hf)
c = policy.codec
policy.rl_step(synthetic_batch(0, 8, policy.bridge.vocab_size, len(c.moe_layers), c.top_k, c.num_experts), 40.0)


def pauses() -> dict:
    ms = []
    for _ in range(a.reps):
        t = time.perf_counter()
        gc.collect()
        ms.append((time.perf_counter() - t) * 1e3)
    return {"ms": ms, "median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms),
            "tracked_objects": len(gc.get_objects())}


unfrozen = pauses()
StepCollector(freeze=True, interval=0).after_setup()
frozen = pauses()
json.dump({"unfrozen": unfrozen, "frozen": frozen, "frozen_objects": gc.get_freeze_count()}, open(a.out, "w"))
destroy()
