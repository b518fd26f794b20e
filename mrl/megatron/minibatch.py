"""Mini-batches of a rollout batch: which samples each optimizer step trains on, pi_old before the first step,
each mini-batch's loss normalizer and the steps' metrics (``Policy.rl_step`` runs the steps).

A rollout batch of n samples feeds ``algo.mini_batches * algo.ppo_epochs`` optimizer steps. Each DP rank
trains on its share (``dp_share``: consecutive samples) and splits it into ``algo.mini_batches`` equal
consecutive parts; mini-batch k is part k of every DP rank's share. So each rank keeps training on the
samples ``mrl.megatron.batch_scatter`` delivered to it, and every rank knows every mini-batch's samples
(their lengths make the micro-batch plan, the same on every rank). With one mini-batch it is the batch.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from mrl.algo import importance_correction
from mrl.config.schema import Aggregation, Correction, OldLogprobs
from mrl.megatron import compat
from mrl.megatron.batch import RLBatch, dp_share
from mrl.megatron.collectives import named
from mrl.megatron.train_step import MicroBatch, forward_backward

PER_STEP = ("clip_frac_low", "clip_frac_high", "dual_clip_frac", "ratio_mean", "approx_kl")
"""Loss metrics reported per optimizer step when a rollout batch feeds several (``minibatch/<j>/<key>``)."""


def mini_batch_samples(n: int, dp_size: int, mini_batches: int) -> list[list[int]]:
    """Whole-batch sample indices of each mini-batch, DP rank 0's part first (so ``dp_share`` of the list
    is each rank's own part)."""
    share = len(dp_share(n, dp_size, 0))
    if share % mini_batches:
        raise ValueError(f"algo.mini_batches={mini_batches}: a batch of {n} samples over dp={dp_size} gives each DP "
                         f"rank {share}, which do not split into {mini_batches} equal mini-batches; choose a divisor "
                         "of train.prompts_per_step * rollout.n_samples_per_prompt / dp")
    part = share // mini_batches
    return [[r * share + k * part + j for r in range(dp_size) for j in range(part)] for k in range(mini_batches)]


def trained_count(batch: RLBatch, i: int, aggregation: Aggregation) -> int:
    """Sample ``i``'s share of the loss normalizer as ``mrl.trainer.batch.build_batch`` counts it: its trained
    response tokens (token_mean), or 1 if it has any (the per-sequence aggregations)."""
    at = batch.local(i)
    resp = len(batch.tokens[at]) - batch.prompt_lens[at]
    tokens = sum(batch.loss_mask[at]) if batch.loss_mask is not None else resp
    return tokens if aggregation is Aggregation.token_mean else int(tokens > 0)


def old_logprobs(policy, plans: list[list[MicroBatch]], passes: dict,
                 cut: Callable[[int, int], list[MicroBatch]] | None = None) -> list[list[dict[str, Any]] | None]:
    """pi_old into each micro-batch's ``data["old"]`` before ``policy``'s first optimizer step; returns each
    mini-batch's forward outputs under the weights before it, one per micro-batch of ``plans`` (None: its own
    first training forward will be, as for the first mini-batch, unless masked IS must know its rejections
    before the loss). ``passes``: ``forward_backward``'s arguments for this step's forwards. ``cut(k, size)``:
    mini-batch k in micro-batches of ``size``, for a pass whose micro-batches are not the training's
    (``algo.old_logprob_micro_batch_size``; its outputs are then re-cut to ``plans``' rows)."""
    algo = policy.cfg.algo
    if algo.old_logprobs is OldLogprobs.engine:
        for mb in (mb for plan in plans for mb in plan):
            mb.data["old"] = mb.data["behav"]
        return [None] * len(plans)
    masked = algo.correction is Correction.mis

    def rejected(lp, mb):  # the sequences masked IS rejects, from the mask the loss will see
        d = mb.data
        counted = importance_correction(lp, d["behav"], d["mask"], algo).counted
        return lp.sum() * 0.0, {"rejected": (d["mask"] > 0).any(-1) & ~counted.any(-1)}

    size = algo.old_logprob_micro_batch_size
    own = cut is not None and size not in (None, policy.cfg.train.micro_batch_size)
    before: list[list[dict[str, Any]] | None] = [None] * len(plans)
    for k, mbs in enumerate(plans):
        if k == 0 and not masked:
            continue
        fwd = cut(k, size) if own else mbs
        outs = forward_backward(policy.model, policy.layout, fwd, forward_only=True,
                                loss_fn=rejected if masked else None, **passes)
        before[k] = recut(fwd, outs, mbs) if own else outs
        for mb, o in zip(mbs, before[k]):
            mb.data["old"] = o["logprobs"]
    return before


def recut(src: list[MicroBatch], outs: list[dict[str, Any]], dst: list[MicroBatch]) -> list[dict[str, Any]]:
    """Forward outputs of micro-batches ``src`` re-cut to the rows of ``dst`` (the same samples in other
    micro-batches): each sample's ``logprobs`` row (its first T-1 positions; a row's width is its micro-batch's
    longest sample, so the shorter of the two widths covers every position of the sample) and, with masked IS,
    its ``rejected`` flag. [] where ``outs`` is (not the last pipeline stage)."""
    if not outs:
        return []
    at = {s: (o, j) for mb, o in zip(src, outs) for j, s in enumerate(mb.samples)}
    recut_outs = []
    for mb in dst:
        got = [at[s] for s in mb.samples]
        first = got[0][0]["logprobs"]
        width = mb.data["mask"].shape[1]
        lp = torch.zeros(len(got), width, dtype=first.dtype, device=first.device)
        for i, (o, j) in enumerate(got):
            w = min(width, o["logprobs"].shape[1])
            lp[i, :w] = o["logprobs"][j, :w]
        out: dict[str, Any] = {"logprobs": lp}
        if "rejected" in got[0][0]:
            out["rejected"] = torch.stack([o["rejected"][j] for o, j in got])
        recut_outs.append(out)
    return recut_outs


def loss_normalizers(policy, batch: RLBatch, plans: list[list[MicroBatch]], before: list,
                     normalizer: float) -> list[torch.Tensor | None]:
    """Each mini-batch's loss normalizer on the device: ``normalizer`` itself for a single mini-batch (made by a
    fill: no host copy), else the mini-batch's trained tokens (or sequences) summed over the DP group, without
    the sequences masked IS rejects (``before``: ``old_logprobs``'s outputs). Only the last PP stage computes a
    loss (None elsewhere)."""
    algo, layout = policy.cfg.algo, policy.layout
    masked = algo.correction is Correction.mis
    if len(plans) == 1 and not masked:
        return [torch.full((), float(normalizer), dtype=torch.float32, device=compat.DEVICE)]
    if not layout.is_last_stage:
        return [None] * len(plans)
    counts = []
    for k, mbs in enumerate(plans):
        n = 0
        for j, mb in enumerate(mbs):
            drop = [bool(r) for r in before[k][j]["rejected"].tolist()] if masked else [False] * len(mb.samples)
            n += sum(trained_count(batch, i, algo.aggregation) for i, d in zip(mb.samples, drop) if not d)
        counts.append(float(n))
    return normalizers(counts, layout.dp.group if layout.dp.size > 1 else None, compat.DEVICE)


def _mean(values: list[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0


def mean_metrics(outs: list[dict[str, Any]]) -> dict[str, float]:
    """Each loss metric (0-dim tensors, every key but ``logprobs``) averaged over the micro-batches,
    with one host sync for all of them (not one per value)."""
    keys = [k for k in outs[0] if k != "logprobs"]
    if not keys:
        return {}
    vals = torch.stack([torch.stack([torch.as_tensor(o[k], dtype=torch.float64, device=outs[0]["logprobs"].device)
                                     .reshape(()) for k in keys]) for o in outs]).T.tolist()
    return {k: _mean(v) for k, v in zip(keys, vals)}


def step_metrics(steps: list[list[dict[str, Any]]]) -> dict[str, float]:
    """The loss metrics of a rollout batch's optimizer steps (each step's micro-batch outputs): averaged over
    the steps, and each step's ``PER_STEP`` ones as ``minibatch/<j>/<key>`` when there are several."""
    per_step = [mean_metrics(outs) for outs in steps]
    out = {k: _mean([m[k] for m in per_step]) for k in per_step[0]}
    if len(steps) > 1:
        out |= {f"minibatch/{j}/{k}": m[k] for j, m in enumerate(per_step) for k in PER_STEP if k in m}
    return out


def normalizers(local_counts: list[float], group, device) -> list[torch.Tensor]:
    """Each mini-batch's loss normalizer: this DP rank's counts summed over the DP ``group`` (None: one rank),
    as 0-dim float32 tensors on ``device`` (the loss divides by them on the device)."""
    box = torch.tensor(local_counts, dtype=torch.float64, device=device)
    if group is not None:
        with named("the mini-batches' loss normalizers", group=group):
            dist.all_reduce(box, group=group)
    return list(box.float().unbind())
