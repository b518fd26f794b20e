"""torchrun worker of bench/rl_step_vs_megatron.py: mrl's RL step, ``Policy.rl_step`` (GRPO loss, TIS
correction, replayed routes, packing, optimizer step, reduced metrics), on the same shape, layout and
tokens as the megatron baseline: ``--micro-batches`` x ``--micro-batch-size`` samples of exactly
``--seq`` tokens per DP rank (a quarter prompt, the rest response), ``--micro-batch-size`` per
micro-batch. Routes are the model's natural routing, recorded before the timing (a RECORD pass per batch,
as the engine would have routed them).

``--profile DIR``: after the timing, two more steps under the torch profiler; writes the top operators
by device time and the host syncs counted (``aten::item``, ``aten::_local_scalar_dense``, stream syncs).
"""

import argparse
import json
import os
import statistics

import numpy as np
import torch

from _bench_common import (GcTimes, HostLead, allocator_counts, gc_mode, profile_steps, record_routes,
                           step_worker_args, timed)
from mrl.config.schema import Config, DType, GroupedGemm, ModelConfig, ParallelConfig, TrainConfig
from mrl._compat.te import parallel_cross_entropy
from mrl.megatron import compat
from mrl.megatron.parallel import destroy, init_parallel
from mrl.megatron.policy import Policy, RLBatch
from mrl.megatron.train_step import MicroBatch

ap = step_worker_args(argparse.ArgumentParser())
ap.add_argument("--packing", choices=["on", "off"], default="on")
ap.add_argument("--fused-router-replay", choices=["on", "off"], default="off",
                help="train.fused_router_replay: replay through TE's fused router kernels")
ap.add_argument("--fused-logprob", choices=["on", "off"], default="on",
                help="train.fused_logprob: token logprobs with TE's fused cross-entropy kernel")
ap.add_argument("--profile", default=None)
ap.add_argument("--phases", action="store_true",
                help="after the timing, two more steps with each phase of rl_step timed between device syncs")
ap.add_argument("--host-lead", action="store_true",
                help="after the timing, two more steps with HostLead marks: how far the host ran ahead of the GPU at "
                     "each micro-batch's forward, after backward and at the optimizer step")
ap.add_argument("--out", required=True)
a = ap.parse_args()

world = int(os.environ.get("WORLD_SIZE", "1"))
# the kernel the bench chose for both sides (Policy sets TE's variable from the config)
GROUPED_GEMM = GroupedGemm.cutlass if os.environ.get("NVTE_USE_CUTLASS_GROUPED_GEMM") == "1" else GroupedGemm.cublas
pcfg = ParallelConfig(tp=a.tp, ep=a.ep, sequence_parallel=True, world_size=world)
cfg = Config(model=ModelConfig(hf_path=a.hf, dtype=DType.bf16 if compat.HAS_CUDA else DType.fp32,
                               make_tiny_if_missing=False), parallel=pcfg,
             train=TrainConfig(micro_batch_size=a.micro_batch_size, replay=True, packing=a.packing == "on",
                               optimizer_states_dtype=DType(a.optimizer_states),
                               grouped_gemm=GROUPED_GEMM,
                               fused_router_replay=a.fused_router_replay == "on",
                               fused_logprob=a.fused_logprob == "on"))
layout = init_parallel(pcfg, seed=cfg.seed)
policy = Policy(cfg, layout, a.hf)
codec, V = policy.codec, policy.bridge.vocab_size
n = a.micro_batches * a.micro_batch_size * layout.dp.size
prompt = a.seq // 4
rng = np.random.default_rng(0)


def make_batch() -> tuple[RLBatch, float]:
    """One step's samples, the same on every rank (as the controller broadcasts them), with routes."""
    tokens = [rng.integers(0, V, size=a.seq).tolist() for _ in range(n)]
    batch = RLBatch(tokens=tokens, prompt_lens=[prompt] * n,
                    behav_logp=[(-2.0 - rng.random(a.seq - prompt)).tolist() for _ in range(n)],
                    advantages=rng.standard_normal(n).tolist(), routes=None)
    ids = torch.tensor(tokens, dtype=torch.long)
    mbs = [MicroBatch(ids[i:i + 1].to(compat.DEVICE)) for i in range(n)]
    rec = record_routes(policy.module, layout, policy.record.slice, policy.tcfg, mbs, vocab_size=V,
                        num_layers=len(codec.moe_layers), top_k=codec.top_k, num_experts=codec.num_experts)
    routes = torch.cat(rec).cpu().numpy().astype(np.uint8 if codec.num_experts <= 256 else np.int32)
    batch.routes = [routes[i, :a.seq - 1] for i in range(n)]
    return batch, float(n * (a.seq - prompt))  # token-mean normalizer: every response token of the batch


batches = [make_batch() for _ in range(a.warmup + a.reps)]


def expert_load(batch: RLBatch) -> list[float]:
    """Share of the step's (token, layer, k) assignments that land on each EP rank's experts (all DP
    ranks' samples: the all-to-all brings every token to its experts' rank). An uneven share makes one
    rank wait for the other at every all-to-all."""
    ep = max(a.ep, 1)
    per_rank = codec.num_experts // ep
    counts = np.zeros(ep)
    for r in batch.routes:
        counts += np.bincount((r.astype(np.int64) // per_rank).ravel(), minlength=ep)[:ep]
    return (counts / counts.sum()).tolist()


load = [expert_load(b) for b, _ in batches[a.warmup:]]
metrics: dict = {}


def step(b) -> None:
    metrics.update(policy.rl_step(*b))


gc_mode(a.gc)
gc_times = GcTimes().start()  # warm-up and timed steps
alloc_before = allocator_counts()
times = [timed(lambda b=b: step(b)) for b in batches]
gc_timed = gc_times.snapshot()
alloc_after = allocator_counts()


def phases() -> dict:
    """Seconds per phase of ``rl_step`` (each between device syncs, so phases do not overlap; the sum
    exceeds an unsynchronised step): where the RL step's extra time over megatron's goes."""
    import time

    import mrl.megatron.policy as pol

    spent: dict[str, list[float]] = {}

    def timed_call(name, fn):
        def run(*args, **kw):
            if compat.HAS_CUDA:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fn(*args, **kw)
            if compat.HAS_CUDA:
                torch.cuda.synchronize()
            spent.setdefault(name, []).append(time.perf_counter() - t0)
            return out
        return run

    pol.forward_backward = timed_call("forward_backward", pol.forward_backward)
    for name in ("micro_batches", "_step_if_finite", "_engine_gap", "_reduce"):  # the step holds optimizer.step
        setattr(policy, name, timed_call(name, getattr(policy, name)))
    policy.optimizer.step = timed_call("optimizer.step", policy.optimizer.step)
    total = [timed(lambda b=b: step(b)) for b in batches[-2:]]
    return {"step_s": total, **{k: v for k, v in spent.items()}}


def every_rank(x):
    """``x`` of every rank, in rank order (phases differ by rank when one waits for another)."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, x)
    return out


def host_lead() -> list[list[dict]]:
    """Two more steps, marked at the same points as the megatron worker marks its own (``HostLead``)."""
    lead, seen = HostLead(), {"mb": 0}
    before, after, step_if = policy.replay.before_forward, policy.replay.after_forward, policy._step_if_finite
    opt_step = policy.optimizer.step

    def before_forward(*args, **kw):
        lead.mark(f"forward {seen['mb']}")
        return before(*args, **kw)

    def after_forward(out):
        lead.mark(f"forward {seen['mb']} out")
        seen["mb"] += 1
        return after(out)

    def step_if_finite(outs):
        lead.mark("backward queued")
        return step_if(outs)

    def optimizer_step(*args, **kw):
        lead.mark("optimizer.step")
        return opt_step(*args, **kw)

    policy.replay.before_forward, policy.replay.after_forward = before_forward, after_forward
    policy._step_if_finite, policy.optimizer.step = step_if_finite, optimizer_step
    out = []
    for b in batches[-2:]:
        seen["mb"] = 0
        lead.start()
        step(b)
        out.append(lead.stop())
    policy.replay.before_forward, policy.replay.after_forward = before, after
    policy._step_if_finite, policy.optimizer.step = step_if, opt_step
    return out


lead_marks = every_rank(host_lead()) if a.host_lead else None
prof = profile_steps(lambda: [step(b) for b in batches[-2:]], 2, a.profile, "rl_step_profile",
                     layout.world_rank) if a.profile else None
phase_times = every_rank(phases()) if a.phases else None
if layout.world_rank == 0:
    json.dump({"side": "mrl", "step_s": times[a.warmup:], "warmup_s": times[:a.warmup],
               "median_s": statistics.median(times[a.warmup:]), "gc": gc_timed,
               "allocator": {"before": alloc_before, "after": alloc_after}, "tokens_per_step": n * a.seq,
               "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if compat.HAS_CUDA else None,
               "spec": "transformer_engine" if policy.tcfg.moe_grouped_gemm else "local",
               "fused_router_replay": cfg.train.fused_router_replay,
               # TE's kernel where it ran: TE present and no padding columns in the vocabulary shards
               "fused_logprob": bool(cfg.train.fused_logprob and parallel_cross_entropy() is not None
                                     and policy.bridge.padded_vocab(cfg.model.vocab_divisible_by, a.tp) == V),
               "fusions": {k: getattr(policy.tcfg, k) for k in ("apply_rope_fusion", "bias_activation_fusion",
                                                                 "moe_permute_fusion", "moe_router_fusion",
                                                                 "gradient_accumulation_fusion")},
               "profile": prof, "phases_s": phase_times[0] if phase_times else None,
               "phases_s_per_rank": phase_times, "expert_load_per_ep_rank": load,
               "host_lead_per_rank": lead_marks,
               "last_metrics": {k: float(v) for k, v in metrics.items()}}, open(a.out, "w"))
destroy()
