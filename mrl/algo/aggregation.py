"""Reduce per-token losses ``[B, T]`` to one scalar, in a way that micro-batches and DP ranks can share.

Every mode is ``sum_i sum_t c_it * loss_it / normalizer`` with a per-token coefficient ``c`` that depends
only on the token's own sequence, so a batch split into micro-batches (whole sequences) sums back to the
full-batch loss when each micro-batch divides by the *global* normalizer:

    normalizer = sum(loss_normalizer(mb.mask, mode) for mb in micro_batches)  # + all-reduce over DP
    loss = sum(aggregate(mb.loss, mb.mask, mode, normalizer=normalizer) for mb in micro_batches)

Shapes: B sequences, T padded response tokens; ``mask`` is bool or 0/1 float, true on response tokens.
"""

from __future__ import annotations

import torch

from mrl.config.schema import Aggregation


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over true ``mask`` entries (0 where none); masked entries may hold inf/nan."""
    m = mask.bool()
    total = torch.where(m, x, 0).sum() if dim is None else torch.where(m, x, 0).sum(dim)
    count = m.sum() if dim is None else m.sum(dim)
    return total / count.clamp(min=1)


def loss_normalizer(mask: torch.Tensor, aggregation: Aggregation) -> torch.Tensor:
    """This batch's share of the normalizer: response tokens (token_mean) or sequences with >= 1 token."""
    m = mask.bool()
    if aggregation is Aggregation.token_mean:
        return m.sum()
    return m.any(dim=-1).sum()


def aggregate(
    loss_BT: torch.Tensor,
    mask: torch.Tensor,
    aggregation: Aggregation,
    *,
    normalizer: float | torch.Tensor | None = None,
    max_response_len: int | None = None,
) -> torch.Tensor:
    """Scalar loss; ``normalizer`` defaults to this batch's own (``loss_normalizer``).

    token_mean: sum of token losses / tokens. seq_mean_token_mean: sum over sequences of the sequence's
    token mean / sequences. seq_mean_token_sum_norm (Dr. GRPO): sum of token losses / max_response_len
    / sequences. Sequences must not be split across micro-batches (the token mean needs the whole one).
    """
    m = mask.bool()
    x_BT = torch.where(m, loss_BT, 0)
    if aggregation is Aggregation.token_mean:
        total = x_BT.sum()
    elif aggregation is Aggregation.seq_mean_token_mean:
        total = (x_BT.sum(dim=-1) / m.sum(dim=-1).clamp(min=1)).sum()
    elif aggregation is Aggregation.seq_mean_token_sum_norm:
        if max_response_len is None:
            raise ValueError("algo.max_response_len: must be set for aggregation=seq_mean_token_sum_norm")
        total = x_BT.sum() / max_response_len
    else:
        raise ValueError(f"algo.aggregation: unknown mode {aggregation!r}")
    if normalizer is None:
        normalizer = loss_normalizer(mask, aggregation)
    return total / torch.as_tensor(normalizer, dtype=total.dtype, device=total.device).clamp(min=1)
