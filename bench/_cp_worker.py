"""torchrun worker of bench/cp2_vs_cp1.py: ``Policy`` with ``parallel.cp=--cp`` on one RL batch of long responses.

Both runs take the same GPUs and EP (``--ep``): the reference is CP=1 (DP over the GPUs), the other ``--cp``.
``--mode reference``: makes the batch (random tokens; routes = this model's own natural
routing, recorded, standing in for an engine's) and saves it to ``--batch``; then the same as ``cp``.
``--mode cp``: loads ``--batch``. Both: the per-token logprobs of every response token under replayed routes
(forward only, the weights as loaded), how often each MoE layer's own top-k, computed from the scores of that
replayed forward, picks the replayed experts (``route_agreement_replay_on``: a route fed to the wrong token
would make it chance), then ``--steps`` timed ``Policy.rl_step`` calls (the first a warm-up) with the first
step's loss metrics, and the peak GPU memory of any rank.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf", required=True)
    ap.add_argument("--mode", choices=["reference", "cp"], required=True)
    ap.add_argument("--cp", type=int, required=True)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--batch", required=True, help="the batch file (written by --mode reference, read by cp)")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--response", type=int, default=16384)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--packing", choices=["on", "off"], default="on")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--optimizer-states", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    check_args(a, ap)
    return a


def check_args(a: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
    if a.mode == "reference" and a.cp != 1:
        ap.error(f"--mode reference runs CP=1, got --cp {a.cp}")
    if a.mode == "cp" and a.cp < 2:
        ap.error(f"--mode cp needs --cp >= 2, got {a.cp}")
    for key in ("samples", "prompt", "response", "micro_batch_size", "ep"):
        if getattr(a, key) < 1:
            ap.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(a, key)}")
    if a.steps < 2:
        ap.error(f"--steps must be >= 2 (the first is a warm-up), got {a.steps}")


def make_batch(a, policy, layout):
    import numpy as np
    import torch

    from _bench_common import record_routes
    from mrl.megatron import compat
    from mrl.megatron.batch import RLBatch
    from mrl.megatron.train_step import MicroBatch

    rng = np.random.default_rng(0)
    v, codec = policy.bridge.vocab_size, policy.codec
    n = a.prompt + a.response
    tokens = [rng.integers(3, v, size=n).tolist() for _ in range(a.samples)]
    batch = RLBatch(tokens=tokens, prompt_lens=[a.prompt] * a.samples,
                    behav_logp=[(-2.0 - rng.random(a.response)).tolist() for _ in range(a.samples)],
                    advantages=rng.standard_normal(a.samples).tolist(), routes=None)
    ids = torch.tensor(tokens)
    mbs = [MicroBatch(ids[j:j + 1].to(compat.DEVICE)) for j in range(a.samples)]
    rec = record_routes(policy.module, layout, policy.record.slice, policy.tcfg, mbs, vocab_size=v,
                        num_layers=len(codec.moe_layers), top_k=codec.top_k, num_experts=codec.num_experts)
    routes = torch.cat(rec).cpu().numpy().astype(np.uint8 if codec.num_experts <= 256 else np.int32)
    batch.routes = [routes[i, :n - 1] for i in range(a.samples)]
    return batch


def replayed_logprobs(policy, layout, batch):
    """Response-token logprobs per sample under replayed routes, and the agreement of the routers' own top-k
    with the replayed experts on the tokens the engine routed (every CP rank's tokens counted once)."""
    import torch
    import torch.distributed as dist

    from mrl.megatron import compat
    from mrl.megatron.train_step import forward_backward
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    calls: dict[int, list[torch.Tensor]] = {}
    wrapped = []
    for k, inst in enumerate(policy.replay.instances):
        orig = inst.get_replay_topk

        def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None,
                            _inst=inst, _orig=orig, _k=k):
            probs, idx = _orig(scores, topk, num_groups, group_topk, default_compute_topk)
            if _inst.router_replay_action == RouterReplayAction.REPLAY_FORWARD:
                _, natural = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
                calls.setdefault(_k, []).append((natural.sort(-1).values == idx.sort(-1).values).all(-1))
            return probs, idx

        inst.get_replay_topk = get_replay_topk
        wrapped.append(inst)
    try:
        mbs, _ = policy.micro_batches(batch, True)
        outs = forward_backward(policy.model, layout, mbs, vocab_size=policy.bridge.vocab_size, forward_only=True,
                                driver=policy.replay, temperature=policy.temperature)
    finally:
        for inst in wrapped:
            del inst.get_replay_topk
    agree = torch.zeros(2, dtype=torch.float64, device=compat.DEVICE)
    for j, mb in enumerate(mbs):
        valid = policy.replay.slice.rows(mb.data["valid"], mb.positions) > 0
        for same in calls.values():  # one call per micro-batch and MoE layer, in micro-batch order
            agree[0] += same[j][valid].sum()
            agree[1] += valid.sum()
    dist.all_reduce(agree)  # every rank's own tokens (CP chunks, SP chunks)
    lps = {}
    for o, mb in zip(outs, mbs):
        for row, i in enumerate(mb.samples):
            p, n = batch.prompt_lens[i], len(batch.tokens[i])
            lps[i] = o["logprobs"][row, p - 1:n - 1].float().cpu()
    everyone = [None] * dist.get_world_size()  # DP ranks hold their own samples, CP ranks the same ones
    dist.all_gather_object(everyone, lps)
    lps = {i: lp for d in everyone for i, lp in d.items()}
    return lps, float(agree[0] / agree[1].clamp(min=1))


def main(argv=None) -> None:
    a = parse_args(argv)
    import torch
    import torch.distributed as dist

    from mrl.algo import loss_normalizer
    from mrl.config.schema import Config, DType, ModelConfig, ParallelConfig, TrainConfig
    from mrl.megatron.batch import RLBatch
    from mrl.megatron.parallel import destroy, init_parallel
    from mrl.megatron.policy import Policy

    world = int(os.environ.get("WORLD_SIZE", "1"))
    pcfg = ParallelConfig(cp=a.cp, ep=a.ep, world_size=world)
    cfg = Config(model=ModelConfig(hf_path=a.hf, dtype=DType.bf16, make_tiny_if_missing=False), parallel=pcfg,
                 train=TrainConfig(micro_batch_size=a.micro_batch_size, replay=True, packing=a.packing == "on",
                                   optimizer_states_dtype=DType(a.optimizer_states)))
    layout = init_parallel(pcfg, seed=cfg.seed)
    policy = Policy(cfg, layout, a.hf)
    if a.mode == "reference":  # every rank makes the same batch and records its routes over all of it
        batch = make_batch(a, policy, layout)
        if layout.world_rank == 0:
            torch.save({"tokens": batch.tokens, "prompt_lens": batch.prompt_lens, "behav_logp": batch.behav_logp,
                        "advantages": batch.advantages, "routes": batch.routes}, a.batch)
    else:
        batch = RLBatch(**torch.load(a.batch, weights_only=False))
    lps, agreement = replayed_logprobs(policy, layout, batch)
    normalizer = float(loss_normalizer(torch.ones(len(batch), a.response), cfg.algo.aggregation))
    torch.cuda.reset_peak_memory_stats()
    times, first = [], None
    for _ in range(a.steps):
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        m = policy.rl_step(batch, normalizer)
        torch.cuda.synchronize()
        dist.barrier()
        times.append(time.perf_counter() - t0)
        first = first or m
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device="cuda")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if layout.world_rank == 0:
        torch.save({i: lp for i, lp in lps.items()}, a.out + ".logprobs.pt")
        with open(a.out, "w") as f:
            json.dump({"cp": a.cp, "ep": a.ep, "world_size": world, "route_agreement_replay_on": agreement,
                       "step_s": statistics.median(times[1:]), "step_s_all": times,
                       "peak_memory_gib": float(peak), "first_step": {k: first[k] for k in
                                                                       ("pg_loss", "grad_norm", "approx_kl",
                                                                        "logprob_diff_replay_on") if k in first},
                       "tokens_per_step": sum(len(t) for t in batch.tokens)}, f, indent=1)
    destroy()


if __name__ == "__main__":
    main()
