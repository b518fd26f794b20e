"""Per-token KL(pi || pi_ref) estimators (Schulman, "Approximating KL Divergence", 2020)."""

from __future__ import annotations

import torch

from mrl.config.schema import KLEstimator

_MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8: keeps k3 finite for far-apart policies


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Elementwise estimate of KL(pi || pi_ref) from tokens sampled by (roughly) pi.

    With log_r = ref_logp - logp: k1 = -log_r (unbiased, can be negative), k2 = log_r^2 / 2,
    k3 = exp(log_r) - 1 - log_r (unbiased, >= 0; GRPO's choice). Gradients flow through ``logp``.
    """
    log_r = ref_logp - logp
    if estimator is KLEstimator.k1:
        return -log_r
    if estimator is KLEstimator.k2:
        return 0.5 * log_r.square()
    if estimator is KLEstimator.k3:
        log_r = log_r.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        return log_r.exp() - 1.0 - log_r
    raise ValueError(f"algo.kl_estimator: unknown estimator {estimator!r}")
