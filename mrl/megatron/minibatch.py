"""Mini-batches of a rollout batch: which samples each optimizer step trains on, and its loss normalizer.

A rollout batch of n samples feeds ``algo.mini_batches * algo.ppo_epochs`` optimizer steps. Each DP rank
trains on its share (``dp_share``: consecutive samples) and splits it into ``algo.mini_batches`` equal
consecutive parts; mini-batch k is part k of every DP rank's share. So each rank keeps training on the
samples ``mrl.megatron.batch_scatter`` delivered to it, and every rank knows every mini-batch's samples
(their lengths make the micro-batch plan, the same on every rank). With one mini-batch it is the batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mrl.config.schema import Aggregation
from mrl.megatron.batch import RLBatch, dp_share
from mrl.megatron.collectives import named


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


def normalizers(local_counts: list[float], group, device) -> list[torch.Tensor]:
    """Each mini-batch's loss normalizer: this DP rank's counts summed over the DP ``group`` (None: one rank),
    as 0-dim float32 tensors on ``device`` (the loss divides by them on the device)."""
    box = torch.tensor(local_counts, dtype=torch.float64, device=device)
    if group is not None:
        with named("the mini-batches' loss normalizers", group=group):
            dist.all_reduce(box, group=group)
    return list(box.float().unbind())
