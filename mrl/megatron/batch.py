"""A step's RL batch (``RLBatch``) and what a DP rank's share of it carries from the whole batch.

Rank 0 builds the whole batch; each rank trains on its DP rank's share (``dp_share``), which is all that
``mrl.megatron.batch_scatter`` delivers to it, with the whole batch's figures its micro-batch plan needs
(``WholeBatch``): ``Policy`` makes the same plan from either.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class WholeBatch:
    """What each DP rank's micro-batch plan needs from the step's whole batch when it holds only its own
    samples: every sample's length (packing plans every DP rank's bins, and all ranks pad to the longest
    sample), the widest sampling support (the supports' tensor width) and the supports that could not be
    rebuilt (a whole-batch metric)."""

    lengths: tuple[int, ...]
    support_width: int = 1
    support_unknown: int = 0
    versions: tuple[int, ...] = ()
    """The weight versions that sampled the batch's tokens (the mismatch split reports every version's lag
    on every rank, so that its averages over ranks stay token-weighted)."""

    @classmethod
    def of(cls, batch: "RLBatch") -> "WholeBatch":
        """The figures of ``batch``'s whole batch (``batch`` itself when it is the whole batch)."""
        if batch.whole is not None:
            return batch.whole
        sup = batch.support or []
        return cls(lengths=tuple(len(t) for t in batch.tokens),
                   support_width=max([len(kept) for s in sup for kept in s] + [1]),
                   support_unknown=sum(not kept for s in sup for kept in s),
                   versions=tuple(sorted({v for vs in batch.versions or [] for v in vs})))


def dp_share(n: int, dp_size: int, dp_rank: int) -> range:
    """The samples of an ``n``-sample batch that DP rank ``dp_rank`` trains on (packed or not)."""
    if n % dp_size:
        raise ValueError(f"batch of {n} samples does not split over dp={dp_size}")
    return range(dp_rank * n // dp_size, (dp_rank + 1) * n // dp_size)


@dataclass
class RLBatch:
    """One step's samples, in group order (rank 0 builds it; each rank receives its DP rank's share,
    ``mrl.megatron.batch_scatter``)."""

    tokens: list[list[int]]
    prompt_lens: list[int]
    behav_logp: list[list[float]]
    """Engine logprob of each response token (the behaviour policy)."""
    advantages: list[float]
    routes: list[np.ndarray] | None
    """``[n - 1, moe_layers, K]`` engine routes per sample (None: replay off)."""
    support: list[list[list[int]]] | None = None
    """Keep Sampling Mask: per sample, per response token, the token ids of the engine's sampling
    support (``sampling_mask.engine_support``; [] = could not be rebuilt). None: no mask."""
    support_log_mass: list[list[float]] | None = None
    """Log of the engine's probability mass on each of those supports (behav_logp is over the whole
    vocabulary; behav_logp - mass is the logprob under the distribution that was sampled)."""
    loss_mask: list[list[int]] | None = None
    """Per sample, per response token: 1 = the model generated it (trained), 0 = not (a multi-turn
    episode's tool output: it is context only, its logprob and support are never used). None: all 1."""
    versions: list[list[int]] | None = None
    """Per sample, per response token: the weight version that sampled it (``Sample.versions``), for the
    mismatch split by cause (``mrl.megatron.mismatch``). None: no split."""
    token_advantages: list[list[float]] | None = None
    """Per sample, per response token: the advantage of that token (``mrl.algo.token_advantages``: token-level
    rewards of a process reward or a teacher). None: ``advantages`` holds for every token of its sample."""
    ref_logp: list[list[float]] | None = None
    """Per sample, per response token: the KL reference's logprob from reference engines (``scoring.reference``).
    None: the trainer computes it (``mrl.megatron.reference``) when ``algo.kl_coef > 0``."""
    whole: WholeBatch | None = None
    """Set when this batch holds one DP rank's share of the step's batch: that batch's figures. None: this
    is the whole batch."""
    first: int = 0
    """Position in the whole batch of this batch's first sample (a share is consecutive samples)."""

    def __len__(self) -> int:
        return len(self.tokens)

    def local(self, i: int) -> int:
        """Position here of the whole batch's sample ``i``."""
        j = i - self.first
        if not 0 <= j < len(self.tokens):
            raise ValueError(f"sample {i} is not in this batch (it holds samples {self.first}.."
                             f"{self.first + len(self.tokens) - 1} of the step's batch)")
        return j
