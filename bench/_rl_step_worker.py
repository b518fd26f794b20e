"""torchrun worker of bench/rl_step_vs_bare.py: ``Policy.rl_step`` (GRPO loss through
``mrl.algo.compute_policy_loss``, replayed routes, Policy's micro-batch/padding path, optimizer step)
vs a bare megatron forward/backward of the same model, layout and padded micro-batches (megatron's own
vocab-parallel cross-entropy via ``labels``, no replay), interleaved.

Timed, per repetition (order rotated, every kind on the same batch; garbage collected before each
step, CUDA synchronized around it, wall time of the slowest rank), after ``--warmup`` repetitions:
  rl_step    Policy.rl_step(batch, normalizer): batch -> padded micro-batches, replay, loss, optimizer step, metrics
  rl_fb      the same minus optimizer step and metrics: micro_batches + forward_backward(loss_fn, replay driver)
  bare_fb    zero grads + megatron forward_backward_func, cross-entropy, no replay
  bare_step  bare_fb + optimizer.step()
  ce_fb      mrl's forward_backward (vocab-parallel fp32 log-softmax) with a plain NLL loss, no replay:
             splits rl_fb - bare_fb into "mrl's logprob path" (ce_fb - bare_fb) and "RL loss + replay" (rl_fb - ce_fb)
``--fns`` picks the kinds; ``--phases N`` then runs N more rl_steps with each phase (micro-batches,
forward_backward, optimizer, metrics, reduce) timed on its own, CUDA synchronized around it.
"""

import argparse
import gc
import json
import os
import statistics

import numpy as np
import torch

from _bench_common import record_routes, spread, timed
from mrl.algo import compute_policy_loss, loss_normalizer
from mrl.config.schema import Config, DType, ModelConfig, ParallelConfig, TrainConfig
from mrl.megatron import compat
from mrl.megatron.parallel import destroy, init_parallel
from mrl.megatron.policy import Policy, RLBatch
from mrl.megatron.train_step import MicroBatch, forward_backward
from megatron.core.pipeline_parallel import get_forward_backward_func

ap = argparse.ArgumentParser()
ap.add_argument("--hf", required=True)
ap.add_argument("--tp", type=int, default=1)
ap.add_argument("--ep", type=int, default=1)
ap.add_argument("--etp", type=int, default=None)
ap.add_argument("--dtype", default="fp32")
ap.add_argument("--samples", type=int, default=8, help="global batch (sequences)")
ap.add_argument("--seq", type=int, default=64, help="longest sequence; lengths are drawn in [3/4 seq, seq]")
ap.add_argument("--micro-batch-size", type=int, default=2)
ap.add_argument("--reps", type=int, default=6)
ap.add_argument("--warmup", type=int, default=2)
ap.add_argument("--packing", choices=["on", "off"], default="on",
                help="train.packing of the RL step (loop default: on)")
ap.add_argument("--phases", type=int, default=0,
                help="after the timing: this many more rl_steps with each phase timed (CUDA synchronized around it)")
ap.add_argument("--fns", default="rl_step,rl_fb,bare_fb,bare_step,ce_fb",
                help="comma-separated step kinds to time (rl_step, bare_fb and bare_step give the headline ratios)")
ap.add_argument("--block", type=int, default=1,
                help="steps of one kind in a row per repetition (K > 1: the first is a warm-up for that kind and "
                     "the median of the other K-1 is the repetition's time; kinds no longer alternate step by step)")
ap.add_argument("--out", required=True)
a = ap.parse_args()

world = int(os.environ.get("WORLD_SIZE", "1"))
pcfg = ParallelConfig(tp=a.tp, ep=a.ep, etp=a.etp, sequence_parallel=True, world_size=world)
cfg = Config(model=ModelConfig(hf_path=a.hf, dtype=DType(a.dtype), make_tiny_if_missing=False), parallel=pcfg,
             train=TrainConfig(micro_batch_size=a.micro_batch_size, replay=True, packing=a.packing == "on"))
layout = init_parallel(pcfg, seed=cfg.seed)
policy = Policy(cfg, layout, a.hf)
bridge, codec = policy.bridge, policy.codec
V = bridge.vocab_size

rng = np.random.default_rng(0)
prompt = a.seq // 4


class Case:
    """One RL batch (identical on every rank, as the controller broadcasts it) with its routes = the
    model's natural routing of every sample (recorded on every rank over the whole batch), and the
    bare path's padded micro-batches (this DP rank's). Every timed repetition gets its own Case, the
    same for all step kinds: replaying one fixed batch over and over would repeat the exact per-expert
    GEMM shapes (cached cuBLAS heuristics) while natural routing drifts by bf16 near-ties."""

    def __init__(self):
        lens = rng.integers(3 * a.seq // 4, a.seq + 1, size=a.samples)
        tokens = [rng.integers(0, V, size=int(n)).tolist() for n in lens]
        self.batch = RLBatch(tokens=tokens, prompt_lens=[prompt] * a.samples,
                             behav_logp=[(-2.0 - rng.random(int(n) - prompt)).tolist() for n in lens],
                             advantages=rng.standard_normal(a.samples).tolist(), routes=None)
        masks = torch.zeros(a.samples, int(lens.max()))
        for i, n in enumerate(lens):
            masks[i, :int(n) - prompt] = 1
        self.normalizer = float(loss_normalizer(masks, cfg.algo.aggregation))
        self.real_tokens = int(lens.sum())
        seq_pad = int(lens.max()) + (-int(lens.max())) % layout.tp.size
        self.padded_tokens = a.samples * seq_pad
        all_ids = torch.zeros(a.samples, seq_pad, dtype=torch.long)
        for i, t in enumerate(tokens):
            all_ids[i, :len(t)] = torch.tensor(t)
        rec_mbs = [MicroBatch(all_ids[j:j + a.micro_batch_size].to(compat.DEVICE))
                   for j in range(0, a.samples, a.micro_batch_size)]
        rec = record_routes(policy.module, layout, policy.record.slice, policy.tcfg, rec_mbs, vocab_size=V,
                            num_layers=len(codec.moe_layers), top_k=codec.top_k, num_experts=codec.num_experts)
        routes = torch.cat(rec).cpu().numpy().astype(np.uint8 if codec.num_experts <= 256 else np.int32)
        self.batch.routes = [routes[i, :len(t) - 1] for i, t in enumerate(tokens)]
        self.bare_mbs, _ = policy.micro_batches(self.batch, False)


cases = [Case() for _ in range(a.warmup + a.reps)]
case = cases[0]  # the one the step functions below use

def bare_fb() -> None:
    policy.model.zero_grad_buffer()
    policy.optimizer.zero_grad()
    bare_mbs = case.bare_mbs
    it = iter(bare_mbs)
    seq = bare_mbs[0].input_ids.shape[1]

    def forward_step(_data, m):
        mb = next(it)
        ids = mb.input_ids
        pos = torch.arange(seq, device=ids.device).unsqueeze(0).expand_as(ids)
        labels = torch.roll(ids, -1, dims=1)
        out = m(input_ids=ids, position_ids=pos, attention_mask=None, labels=labels)  # [b, S] token losses

        def loss_func(loss_bs):
            w = mb.data["valid"]  # every real token but the last
            return (loss_bs.float() * w).sum() / w.sum().clamp(min=1), {}

        return out, loss_func

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([None] * len(bare_mbs)),
                                model=[policy.model], num_microbatches=len(bare_mbs), seq_length=seq,
                                micro_batch_size=bare_mbs[0].input_ids.shape[0], forward_only=False)


def bare_step() -> None:
    bare_fb()
    policy.optimizer.step()


def rl_fb() -> None:
    batch, normalizer = case.batch, case.normalizer
    mbs, _ = policy.micro_batches(batch, True)
    algo = cfg.algo

    norm = torch.tensor(float(normalizer), dtype=torch.float32, device=compat.DEVICE)  # as Policy.rl_step

    def loss_fn(lp, mb):
        d = mb.data
        return compute_policy_loss(lp, lp.detach(), d["behav"], d["adv"], d["mask"], algo, normalizer=norm)

    policy.model.zero_grad_buffer()
    policy.optimizer.zero_grad()
    forward_backward(policy.model, layout, mbs, vocab_size=V, loss_fn=loss_fn, driver=policy.replay,
                     loss_scale=float(layout.dp.size))


def ce_fb() -> None:
    bare_mbs = case.bare_mbs
    n = sum(float(mb.data["mask"].sum()) for mb in bare_mbs)

    def loss_fn(lp, mb):
        return -(lp * mb.data["mask"]).sum() / n, {}

    policy.model.zero_grad_buffer()
    policy.optimizer.zero_grad()
    forward_backward(policy.model, layout, bare_mbs, vocab_size=V, loss_fn=loss_fn, driver=None)


metrics = {}


def rl_step() -> None:
    metrics.update(policy.rl_step(case.batch, case.normalizer))




fns = {"rl_step": rl_step, "rl_fb": rl_fb, "bare_fb": bare_fb, "bare_step": bare_step, "ce_fb": ce_fb}
names = a.fns.split(",")
assert {"rl_step", "bare_fb", "bare_step"} <= set(names) <= set(fns), names


def run(n: str) -> float:
    gc.collect()  # no garbage of the previous kind's step is collected inside this one's timing
    return timed(fns[n])


for w in range(a.warmup):
    case = cases[w]
    for n in names:
        run(n)
times = {n: [] for n in names}
real_tokens = 0
for r in range(a.reps):  # every kind once per repetition, on the same batch, in a rotated order
    case = cases[a.warmup + r]
    real_tokens += case.real_tokens
    for n in names[r % len(names):] + names[:r % len(names)]:
        if a.block == 1:
            times[n].append(run(n))
        else:  # a block of this kind: its first step re-warms what the other kinds evicted (allocator, caches)
            times[n].append(statistics.median([run(n) for _ in range(a.block)][1:]))
padded = sum(c.padded_tokens for c in cases[a.warmup:])


def phase_times(n: int) -> dict:
    """Where rl_step's time goes: its phases timed one by one (synchronized; slower than the plain step)."""
    import time

    import mrl.megatron.policy as pol

    acc: dict[str, list[float]] = {}

    def wrap(owner, attr, key):
        fn = getattr(owner, attr)

        def timed_fn(*args, **kw):
            if compat.HAS_CUDA:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                if compat.HAS_CUDA:
                    torch.cuda.synchronize()
                acc.setdefault(key, []).append(time.perf_counter() - t0)

        setattr(owner, attr, timed_fn)
        return fn

    saved = [(pol, "forward_backward", wrap(pol, "forward_backward", "forward_backward")),
             (policy, "micro_batches", wrap(policy, "micro_batches", "micro_batches")),
             (policy.optimizer, "step", wrap(policy.optimizer, "step", "optimizer_step")),
             (policy.scheduler, "step", wrap(policy.scheduler, "step", "scheduler_step")),
             (policy, "_engine_gap", wrap(policy, "_engine_gap", "engine_gap")),
             (pol, "_mean_metrics", wrap(pol, "_mean_metrics", "mean_metrics")),
             (policy, "_reduce", wrap(policy, "_reduce", "reduce"))]
    total = []
    global case
    try:
        for i in range(n):
            case = cases[(a.warmup + i) % len(cases)]
            gc.collect()
            total.append(timed(rl_step))
    finally:
        for owner, attr, fn in saved:
            if owner is pol:
                setattr(owner, attr, fn)
            else:
                delattr(owner, attr) if attr in vars(owner) else setattr(owner, attr, fn)
    out = {k: statistics.median(v) for k, v in acc.items()}
    out["rl_step_total"] = statistics.median(total)
    out["rest"] = out["rl_step_total"] - sum(v for k, v in out.items() if k != "rl_step_total")
    return out


phases = phase_times(a.phases) if a.phases else None
mb_s = []  # host time of Policy's batch -> micro-batches path alone (part of rl_step and rl_fb)
for c in cases[a.warmup:a.warmup + 4]:
    mb_s.append(timed(lambda c=c: policy.micro_batches(c.batch, True)))


def paired(num: str, den: str) -> dict:
    """Throughput of ``den`` relative to ``num`` (time(num) / time(den)) per repetition: same batch."""
    return spread([x / y for x, y in zip(times[num], times[den])])


if layout.world_rank == 0:
    med = {n: statistics.median(v) for n, v in times.items()}
    mins = {n: min(v) for n, v in times.items()}
    real_tokens /= a.reps  # mean real tokens per step
    ratios = {"rl_step_vs_bare_fb": ("bare_fb", "rl_step"), "rl_step_vs_bare_step": ("bare_step", "rl_step")}
    if "rl_fb" in names:
        ratios["rl_fb_vs_bare_fb"] = ("bare_fb", "rl_fb")
    if "rl_fb" in names and "ce_fb" in names:
        ratios["rl_fb_vs_ce_fb"] = ("ce_fb", "rl_fb")
    out = {"times_s": times, "median_s": med, "min_s": mins, "spread_s": {n: spread(v) for n, v in times.items()},
           "tokens_per_s": {n: real_tokens / med[n] for n in names}}
    for key, (fast, slow) in ratios.items():  # throughput ratio slow/fast = time(fast) / time(slow)
        out[key] = med[fast] / med[slow]  # ratio of medians (the headline, as before)
        out[key + "_min"] = mins[fast] / mins[slow]  # ratio of the fastest steps
        out[key + "_paired"] = paired(fast, slow)  # per repetition, same batch: its spread
    out |= {"real_tokens": real_tokens, "padded_tokens": padded / a.reps,
            "micro_batches_per_rank": len(case.bare_mbs), "micro_batch_build_s": statistics.median(mb_s),
            "dp": layout.dp.size, "reps": a.reps, "warmup": a.warmup, "block": a.block, "rl_step_phases_s": phases,
            "last_rl_metrics": {k: float(v) for k, v in metrics.items()}}
    json.dump(out, open(a.out, "w"))
destroy()
