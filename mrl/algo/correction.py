"""Off-policy correction between the trainer's old policy and the engine's behaviour policy.

The behaviour policy pi_behav is the SGLang engine that sampled the tokens: ``behav_logp`` are the
logprobs it returned, possibly from weights several versions older than the trainer's (async
staleness, partial rollouts spanning versions) and computed by different kernels (train/inference
mismatch). ``old_logp`` is the trainer's recompute pi_old on the same tokens before this step's
updates. The weight w = pi_old / pi_behav = exp(old_logp - behav_logp) re-weights each token's
clipped surrogate (whose own ratio is pi / pi_old), correcting both effects at once. When the
trainer does not recompute (old_logp = behav_logp) w = 1 and every mode is a no-op.

Modes (``AlgoConfig.correction``), all detached:
  none    weight 1.
  tis     weight min(w, is_cap)                             (truncated IS)
  mis     weight w if w in [mis_low, mis_high] else 0       (masked IS; per token or per sequence)
  icepop  weight w if w in [icepop_low, icepop_high] else 0 (IcePop, Ring-1T; per token)
A zero weight zeroes the token's gradient; it still counts in the loss normalizer, so the normalizer
stays known before the loss (micro-batches, DP). Sequence level uses the geometric mean
exp(mean_t log w_t) of the sequence's tokens for all of them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mrl.algo.aggregation import masked_mean
from mrl.config.schema import AlgoConfig, Correction, CorrectionLevel

_MAX_LOG_W = 20.0


class ISCorrection(NamedTuple):
    weight: torch.Tensor
    """[B, T] detached factor for each token's loss; 0 on masked-out and rejected tokens."""
    keep: torch.Tensor
    """[B, T] bool: response tokens the correction kept (all of them for none/tis)."""
    metrics: dict[str, torch.Tensor]
    """Detached scalars: is_weight_mean/max (raw w over response tokens), is_clip_frac (tis),
    is_masked_frac and is_masked_tokens (mis/icepop), mismatch_kl (k3 estimate of KL(pi_behav || pi_old))."""


def importance_correction(
    old_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor, cfg: AlgoConfig
) -> ISCorrection:
    """Weights w = pi_old / pi_behav per token or sequence, truncated or masked per ``cfg.correction``."""
    m = mask.bool()
    with torch.no_grad():
        log_w_BT = torch.where(m, old_logp - behav_logp, 0).clamp(-_MAX_LOG_W, _MAX_LOG_W)
        w_tok_BT = log_w_BT.exp()
        metrics = {"mismatch_kl": masked_mean(w_tok_BT - 1.0 - log_w_BT, m)}
        if cfg.correction_level is CorrectionLevel.sequence and cfg.correction in (Correction.tis, Correction.mis):
            log_w_BT = masked_mean(log_w_BT, m, dim=-1)[:, None].expand_as(log_w_BT)
        w_BT = log_w_BT.exp()
        metrics["is_weight_mean"] = masked_mean(w_BT, m)
        metrics["is_weight_max"] = torch.where(m, w_BT, 0).max()

        keep_BT = m
        if cfg.correction is Correction.none:
            weight_BT = torch.ones_like(w_BT)
        elif cfg.correction is Correction.tis:
            weight_BT = w_BT.clamp(max=cfg.is_cap)
            metrics["is_clip_frac"] = masked_mean((w_BT > cfg.is_cap).to(w_BT.dtype), m)
        elif cfg.correction in (Correction.mis, Correction.icepop):
            low, high = (
                (cfg.mis_low, cfg.mis_high) if cfg.correction is Correction.mis else (cfg.icepop_low, cfg.icepop_high)
            )
            keep_BT = m & (w_BT >= low) & (w_BT <= high)
            weight_BT = w_BT
            num_masked = (m.sum() - keep_BT.sum()).to(w_BT.dtype)
            metrics["is_masked_tokens"] = num_masked
            metrics["is_masked_frac"] = num_masked / m.sum().clamp(min=1)
        else:
            raise ValueError(f"algo.correction: unknown mode {cfg.correction!r}")
        weight_BT = torch.where(keep_BT, weight_BT, 0)
    return ISCorrection(weight=weight_BT, keep=keep_BT, metrics=metrics)
