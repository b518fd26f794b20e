"""torchrun worker of bench/loop_e2e.py: the trainer ceiling, ``Policy.rl_step`` alone on batches of
exactly the loop's shapes.

    torchrun --nproc-per-node N bench/_loop_trainer_ceiling.py --prompts P.jsonl --batches 4 --out OUT -- OVERRIDE...

The config is the loop's (the same ``mrl train`` overrides, composed the same way), so layout, dtype,
micro-batch size, packing, optimizer and replay are the loop's. Each batch is ``train.prompts_per_step``
rows of the prompt file in order, ``n_samples_per_prompt`` samples each: the row's prompt tokens
(its own tokenizer) and a response of exactly its budget (the loop stops every sample at its budget),
random response ids, routes from the model's own routing (a RECORD pass before the timing, as the
engine routes a random-init model), advantages N(0, 1). Reported: the batch tokens (prompt +
response) over the rl_step seconds of the timed batches, and the trainer's start as the loop marks it
(``mrl.startup``: imports, groups, the model with its HF weights, the warm-up pass where the loop runs
one, then the first rl_step), counted from
``MRL_LAUNCHED_AT`` (the bench stamps it before torchrun). ``--profile-startup``: cProfile of the model's
build and of the first rl_step (the functions with most cumulative seconds) in the report.
"""

import argparse
import json
import os
import statistics
import sys

import numpy as np
import torch

from _bench_common import record_routes, timed
from mrl.config.load import compose
from mrl.startup import StartupClock
from mrl.megatron import compat
from mrl.megatron.parallel import destroy, init_parallel
from mrl.megatron.policy import Policy, RLBatch
from mrl.megatron.train_step import MicroBatch
from mrl.megatron.warm_up import warm_up

ap = argparse.ArgumentParser()
ap.add_argument("--prompts", required=True)
ap.add_argument("--batches", type=int, default=4)
ap.add_argument("--warmup", type=int, default=1)
ap.add_argument("--out", required=True)
ap.add_argument("--profile-startup", action="store_true")
ap.add_argument("overrides", nargs="*")
a = ap.parse_args()


def profiled(fn, key: str, into: dict):
    """``fn()``, under cProfile when asked: the functions with most cumulative and own seconds go to ``into[key]``."""
    if not a.profile_startup:
        return fn()
    import cProfile
    import pstats

    prof = cProfile.Profile()
    try:
        return prof.runcall(fn)
    finally:
        # (cc, nc, tottime, cumtime, callers) per function; the import machinery's frames wrap everything
        stats = [(f, v) for f, v in pstats.Stats(prof).stats.items()
                 if not f[0].startswith("<frozen") and "builtins.exec" not in f[2]]

        def rows(i: int, n: int) -> list[dict]:
            return [{"function": f"{f[0].split('site-packages/')[-1]}:{f[1]}:{f[2]}", "calls": v[1],
                     "tottime_s": round(v[2], 3), "cumtime_s": round(v[3], 3)}
                    for f, v in sorted(stats, key=lambda kv: -kv[1][i])[:n]]

        into[key] = {"by_cumulative": rows(3, 40), "by_own_time": rows(2, 25)}


clock, profiles = StartupClock(), {}
clock.mark("trainer_imported")
cfg = compose(a.overrides)
layout = init_parallel(cfg.parallel, seed=cfg.seed)
clock.mark("parallel_ready")
policy = profiled(lambda: Policy(cfg, layout, cfg.model.hf_path), "policy_build", profiles)
clock.mark("policy_ready")
codec, V = policy.codec, policy.bridge.vocab_size
from tokenizers import Tokenizer  # noqa: E402

tok = Tokenizer.from_file(os.path.join(cfg.model.hf_path, "tokenizer.json"))
rows = [json.loads(x) for x in open(a.prompts)]
per_step, n = cfg.train.prompts_per_step, cfg.rollout.n_samples_per_prompt
rng = np.random.default_rng(0)


def make_batch(b: int) -> tuple[RLBatch, float, int]:
    """Batch ``b``: rows b*per_step..; every rank builds the same (as the controller sends it)."""
    tokens, plens = [], []
    for row in rows[b * per_step:(b + 1) * per_step]:
        ids = tok.encode(row["prompt"]).ids
        budgets = row["max_new_tokens"]
        for i in range(n):
            tokens.append(ids + rng.integers(3, V, size=budgets[i % len(budgets)]).tolist())
            plens.append(len(ids))
    batch = RLBatch(tokens=tokens, prompt_lens=plens,
                    behav_logp=[(-2.0 - rng.random(len(t) - p)).tolist() for t, p in zip(tokens, plens)],
                    advantages=rng.standard_normal(len(tokens)).tolist(), routes=None)
    if cfg.train.replay:
        tp = layout.tp.size  # sequence parallelism splits each row over TP: pad it to a multiple
        rec = [record_routes(policy.module, layout, policy.record.slice, policy.tcfg,
                             [MicroBatch(torch.tensor([t + [0] * (-len(t) % tp)], dtype=torch.long).to(compat.DEVICE))],
                             vocab_size=V, num_layers=len(codec.moe_layers), top_k=codec.top_k,
                             num_experts=codec.num_experts)[0] for t in tokens]  # one pass a sample: lengths differ
        dt = np.uint8 if codec.num_experts <= 256 else np.int32
        batch.routes = [r[0, :len(t) - 1].cpu().numpy().astype(dt) for r, t in zip(rec, tokens)]
    responses = sum(len(t) - p for t, p in zip(tokens, plens))
    return batch, float(responses), sum(len(t) for t in tokens)


batches = [make_batch(b) for b in range(a.warmup + a.batches)]
if compat.HAS_CUDA:
    torch.cuda.empty_cache()
wp = cfg.train.warmup_pass  # as the loop does before its first step (its effect: the first rl_step below)
warm_pass_s = timed(lambda: warm_up(policy)) if (wp if wp is not None else compat.HAS_CUDA) else None
times = [timed(lambda b=b: profiled(lambda: policy.rl_step(b[0], b[1]), "first_rl_step", profiles) if b is batches[0]
               else policy.rl_step(b[0], b[1])) for b in batches]
step_s, tokens = times[a.warmup:], [b[2] for b in batches[a.warmup:]]
if layout.world_rank == 0:
    json.dump({"step_s": step_s, "warmup_s": times[:a.warmup], "batch_tokens": tokens,
               "tokens_per_s": sum(tokens) / sum(step_s),
               "tokens_per_s_per_batch": [t / s for t, s in zip(tokens, step_s)],
               "median_step_s": statistics.median(step_s), "world_size": layout.world_size,
               "startup_s": clock.marks, "profiles": profiles, "warm_pass_s": warm_pass_s,
               "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if compat.HAS_CUDA else None},
              open(a.out, "w"))
destroy()
sys.exit(0)
