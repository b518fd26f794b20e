"""RL algorithm math, pure torch: advantages (per sample and per token), policy losses, off-policy correction, KL."""

from mrl.algo.advantages import (
    compute_advantages,
    dynamic_sampling_mask,
    group_advantages,
    overlong_penalty,
    rloo_advantages,
    token_advantages,
)
from mrl.algo.aggregation import aggregate, loss_normalizer, masked_mean
from mrl.algo.correction import ISCorrection, importance_correction
from mrl.algo.kl import kl_penalty
from mrl.algo.losses import clipped_surrogate, compute_policy_loss, sequence_log_ratio, token_log_ratio

__all__ = [
    "ISCorrection",
    "aggregate",
    "clipped_surrogate",
    "compute_advantages",
    "compute_policy_loss",
    "dynamic_sampling_mask",
    "group_advantages",
    "importance_correction",
    "kl_penalty",
    "loss_normalizer",
    "masked_mean",
    "overlong_penalty",
    "rloo_advantages",
    "sequence_log_ratio",
    "token_advantages",
    "token_log_ratio",
]
