"""Context parallelism (``parallel.cp``): which sequence positions each CP rank holds, the split of a
micro-batch's per-token tensors into them, and the gather of per-token results back into sequence order.

    split = CPSplit.build(seq_len, cu_seqlens, layout.cp)   # this rank's positions, megatron's split
    ids_local = split.split(ids_BS)                          # [b, S / cp] in the rank's token order
    lp_BS = split.gather(lp_local)                           # back to [b, S], differentiable

megatron-core's split is load-balanced for causal attention: a sequence is cut into ``2 * cp`` equal
chunks and rank r holds chunks r and ``2cp - 1 - r``, in that order (``utils.get_batch_on_this_cp_rank``,
per-sequence balancing). A packed THD micro-batch is split the same way inside every segment (sample slot
or row tail), segments in order (per-document balancing: Transformer Engine's
``thd_get_partitioned_indices``); every segment's length must then be a multiple of ``2 * cp``. The rank's
positions come from those functions themselves (an arange run through them), so tokens, labels, routes,
sampling supports and loss inputs are all taken with one index, the one megatron gives the tokens. Without
Transformer Engine (CPU: no CP attention exists there) a THD split uses ``zigzag_positions``, the same rule
written out.

The loss runs on whole sequences: each rank's per-token logprobs are all-gathered over the CP group into
sequence order, and every CP rank computes the same loss from the same gathered tensor, so every
aggregation (token or sequence means, GSPO's sequence ratio, sequence-level IS weights, masked IS) and
every metric equals CP=1's. The gather's backward hands each rank the gradient of its own positions only
(no reduction: the others' copies of the loss give the others theirs); megatron's schedule multiplies the
loss by the CP size and the DDP gradient reduction averages over DP x CP, so the parameter gradients are
the sum over CP ranks, the gradient of the whole sequence's loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mrl._compat.te import HAVE_TE
from mrl.megatron import compat
from mrl.megatron.parallel import GroupInfo


class ContextParallelError(ValueError):
    pass


def zigzag_positions(seq_len: int, cp_size: int, cp_rank: int, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Sequence positions CP rank ``cp_rank`` holds, in its local order: every segment (``cu_seqlens``
    bounds; None = one sequence) cut into ``2 * cp_size`` chunks, chunks ``cp_rank`` and
    ``2 * cp_size - 1 - cp_rank`` of each, segments in order."""
    bounds = [0, seq_len] if cu_seqlens is None else [int(x) for x in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != seq_len:
        raise ContextParallelError(f"cu_seqlens span {bounds[0]}..{bounds[-1]}, the sequence has {seq_len} positions")
    parts = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if (end - start) % (2 * cp_size):
            raise ContextParallelError(f"segment of {end - start} positions not divisible by 2*cp={2 * cp_size} "
                                       "(context parallelism splits each sequence into 2*cp chunks)")
        chunk = (end - start) // (2 * cp_size)
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
            parts.append(torch.arange(start + c * chunk, start + (c + 1) * chunk))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def megatron_positions(seq_len: int, cu_seqlens: torch.Tensor | None, group, device=None) -> torch.Tensor:
    """This rank's positions from megatron-core's own batch split (``get_batch_on_this_cp_rank``) applied to
    the positions themselves; ``group``: the CP process group (megatron reads size and rank from it). THD
    without Transformer Engine: ``zigzag_positions`` (megatron's per-document split calls TE's kernel)."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    if cu_seqlens is not None:
        _check_segments(cu_seqlens, seq_len, dist.get_world_size(group))
        if not HAVE_TE:
            return zigzag_positions(seq_len, dist.get_world_size(group), dist.get_rank(group), cu_seqlens).to(device)
    pos = torch.arange(seq_len, device=device).unsqueeze(0)
    cu = None if cu_seqlens is None else cu_seqlens.to(device=device, dtype=torch.int32).unsqueeze(0)
    batch = {"tokens": pos, "cu_seqlens": cu, "cu_seqlens_padded": cu}
    return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=group)["tokens"][0].long()


def _check_segments(cu_seqlens: torch.Tensor, seq_len: int, cp_size: int) -> None:
    """Name the segment TE's kernel would split wrongly (it does not check divisibility)."""
    zigzag_positions(seq_len, cp_size, 0, cu_seqlens)


def next_tokens(ids_BS: torch.Tensor) -> torch.Tensor:
    """The token each position predicts, ``[b, S]`` in sequence order (the last position's target wraps
    around: it predicts nothing and is dropped after the gather)."""
    return torch.roll(ids_BS, -1, dims=1)


def _all_gather_positions(x: torch.Tensor, order: torch.Tensor, group, size: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    out = torch.empty((x.shape[0], order.numel(), *x.shape[2:]), dtype=x.dtype, device=x.device)
    return out.index_copy_(1, order, torch.cat(parts, 1))


class _GatherPositions(torch.autograd.Function):
    """All-gather of ``[b, S_local, ...]`` over the CP group into sequence order ``[b, S, ...]``; backward:
    this rank's positions of the gradient, no communication (every CP rank computes the same loss from
    the gathered tensor)."""

    @staticmethod
    def forward(ctx, x, index, order, group, size):
        ctx.save_for_backward(index)
        return _all_gather_positions(x, order, group, size)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        return grad.index_select(1, index), None, None, None, None


@dataclass
class CPSplit:
    """One micro-batch's split over the CP group: this rank's positions and every rank's."""

    index: torch.Tensor
    """This rank's sequence positions, in its local token order (int64, on the micro-batch's device)."""
    order: torch.Tensor
    """Every rank's positions, rank 0's first: where each entry of the ranks' concatenated locals belongs."""
    group: object
    size: int
    rank: int

    @classmethod
    def build(cls, seq_len: int, cu_seqlens: torch.Tensor | None, cp: GroupInfo, device=None) -> "CPSplit":
        """``seq_len``: the model input's sequence length (a packed THD micro-batch's ``b * S``);
        ``cu_seqlens``: its segment bounds (THD), None for one sequence per row. Collective over ``cp``
        (the ranks' positions are all-gathered: the gather needs them, whatever rule made them)."""
        if cp.size < 2:
            raise ContextParallelError("CPSplit needs a context-parallel group of two or more ranks")
        if cu_seqlens is None and seq_len % (2 * cp.size):
            raise ContextParallelError(f"sequence of {seq_len} positions not divisible by 2*cp={2 * cp.size}")
        index = megatron_positions(seq_len, cu_seqlens, cp.group, device)
        parts = [torch.empty_like(index) for _ in range(cp.size)]
        dist.all_gather(parts, index, group=cp.group)
        return cls(index=index, order=torch.cat(parts), group=cp.group, size=cp.size, rank=cp.rank)

    def split(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's positions of a per-token tensor (sequence axis ``dim``), in its token order."""
        return x.index_select(dim, self.index.to(x.device))

    def gather(self, x_local: torch.Tensor) -> torch.Tensor:
        """``[b, S_local, ...]`` of every CP rank -> ``[b, S, ...]`` in sequence order; differentiable (see
        ``_GatherPositions``). Bool tensors travel as uint8 (NCCL reduces no bool)."""
        if x_local.dtype == torch.bool:
            return self.gather(x_local.to(torch.uint8)).bool()
        order = self.order.to(x_local.device)
        if x_local.requires_grad:
            return _GatherPositions.apply(x_local, self.index.to(x_local.device), order, self.group, self.size)
        return _all_gather_positions(x_local.detach(), order, self.group, self.size)


def check_runnable(parallel) -> None:
    """Refuse ``parallel.cp`` > 1 in the process that would run it where it cannot (the preflight's check)."""
    if why := parallel.context_parallel_problem(transformer_engine=HAVE_TE, gpu=compat.HAS_CUDA):
        raise ContextParallelError(why)


def packed_rows(longest: int, pack_max_len: int | None, *, tp: int, cp: int) -> tuple[int, int]:
    """``(row length, slot alignment)`` of packed rows: under CP every sample's slot is a multiple of ``2 * cp``
    (TE splits each packed sequence into ``2 * cp`` chunks) and rows split as ``padded_len`` says."""
    align = 2 * cp if cp > 1 else 1
    return padded_len(max(pack_max_len or 0, -(-longest // align) * align), tp=tp, cp=cp), align


def padded_len(longest: int, *, tp: int, cp: int) -> int:
    """The sequence length a micro-batch is padded to: a multiple of tp (sequence parallelism scatters it
    over TP) and, under CP, of ``2 * cp * tp`` (2 * cp chunks, each rank's half still split over TP)."""
    multiple = tp * (2 * cp if cp > 1 else 1)
    return -(-longest // multiple) * multiple


@dataclass
class LocalInputs:
    """A micro-batch's model inputs and loss targets on this CP rank, all taken with ``split.index``."""

    split: CPSplit
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    """The next token of each local position (``next_tokens``, then split)."""
    support: torch.Tensor | None = None
    """Keep Sampling Mask supports of the local positions ``[b, S_local, K]`` (-1: none)."""


def local_inputs(ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor | None, cp: GroupInfo,
                 support: torch.Tensor | None = None) -> LocalInputs:
    """Split a micro-batch's model input ``[b, S]`` (ids, positions), its targets and its supports
    (``[b, S - 1, K]``, the support of the token at q + 1 at position q) over the CP group."""
    split = CPSplit.build(ids.shape[1], cu_seqlens, cp, device=ids.device)
    if support is not None:  # the last position predicts nothing: an empty support row
        support = split.split(torch.cat([support, support.new_full((support.shape[0], 1, support.shape[2]), -1)], 1))
    return LocalInputs(split, split.split(ids), split.split(position_ids), split.split(next_tokens(ids)), support)
