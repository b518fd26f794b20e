"""Off-policy correction between the trainer's old policy and the engine's behaviour policy.

The behaviour policy pi_behav is the SGLang engine that sampled the tokens: ``behav_logp`` are the
logprobs it returned, possibly from weights several versions older than the trainer's (async
staleness, partial rollouts spanning versions) and computed by different kernels (train/inference
mismatch). ``old_logp`` is pi_old, the policy the PPO ratio pi / pi_old is clipped against: the
trainer's forward before the rollout batch's first optimizer step (``algo.old_logprobs=recompute``,
the proximal policy of AReaL's decoupled PPO). The weight w = pi_old / pi_behav re-weights each token's
clipped surrogate, correcting staleness and mismatch at once. With ``old_logprobs=engine`` w = 1 and
there is nothing to correct (the config refuses a correction then).

Which w (``AlgoConfig.correction_level``):
  token             w_t = pi_old(y_t) / pi_behav(y_t)
  sequence_product  w = prod_t w_t = pi_old(y) / pi_behav(y), on every token of the sequence: the
                    unbiased sequence-level IS weight (its variance grows with the length)
  sequence_geomean  w = exp(mean_t log w_t): the length-normalised form (GSPO's ratio), biased

Modes (``AlgoConfig.correction``), all detached:
  none    weight 1.
  tis     weight min(w, is_cap)                              (truncated IS; Yao et al. 2025)
  mis     weight w if w <= mis_high, else the sequence is rejected: weight 0 and out of the loss
          normalizer (masked IS, Liu et al. 2025, "When Speed Kills Stability"); per sequence only
  icepop  weight w_t if w_t in [icepop_low, icepop_high] else 0 (IcePop, Ring-1T; per token)
A zero weight from tis or icepop zeroes the token's gradient and the token still counts in the loss
normalizer; a sequence mis rejects leaves the normalizer (``ISCorrection.counted``), which the trainer
knows before the loss because pi_old is computed before the batch's first optimizer step.
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
    counted: torch.Tensor
    """[B, T] bool: response tokens that count in the loss normalizer (all but those of sequences mis
    rejected)."""
    metrics: dict[str, torch.Tensor]
    """Detached scalars: is_weight_mean/max (raw w over response tokens), is_clip_frac (tis),
    is_masked_frac and is_masked_tokens (mis/icepop), mismatch_kl (k3 estimate of KL(pi_behav || pi_old))."""


def log_weights(old_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor,
                level: CorrectionLevel) -> torch.Tensor:
    """[B, T] log w at ``level`` (a sequence's value on each of its tokens); 0 on masked positions."""
    m = mask.bool()
    log_w_BT = torch.where(m, old_logp - behav_logp, 0)
    if level is CorrectionLevel.sequence_product:
        log_w_BT = log_w_BT.sum(dim=-1, keepdim=True).expand_as(log_w_BT)
    elif level is CorrectionLevel.sequence_geomean:
        log_w_BT = masked_mean(log_w_BT, m, dim=-1)[:, None].expand_as(log_w_BT)
    return torch.where(m, log_w_BT.clamp(-_MAX_LOG_W, _MAX_LOG_W), 0)


def importance_correction(
    old_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor, cfg: AlgoConfig
) -> ISCorrection:
    """Weights from w = pi_old / pi_behav at ``cfg.correction_level``, truncated or masked per ``cfg.correction``."""
    m = mask.bool()
    with torch.no_grad():
        log_tok_BT = log_weights(old_logp, behav_logp, m, CorrectionLevel.token)
        metrics = {"mismatch_kl": masked_mean(log_tok_BT.exp() - 1.0 - log_tok_BT, m)}
        level = CorrectionLevel.token if cfg.correction in (Correction.none, Correction.icepop) \
            else cfg.correction_level
        w_BT = (log_tok_BT if level is CorrectionLevel.token else log_weights(old_logp, behav_logp, m, level)).exp()
        metrics["is_weight_mean"] = masked_mean(w_BT, m)
        metrics["is_weight_max"] = torch.where(m, w_BT, 0).max()

        keep_BT, counted_BT = m, m
        if cfg.correction is Correction.none:
            weight_BT = torch.ones_like(w_BT)
        elif cfg.correction is Correction.tis:
            weight_BT = w_BT.clamp(max=cfg.is_cap)
            metrics["is_clip_frac"] = masked_mean((w_BT > cfg.is_cap).to(w_BT.dtype), m)
        elif cfg.correction in (Correction.mis, Correction.icepop):
            if cfg.correction is Correction.mis:
                keep_BT = m & (w_BT <= cfg.mis_high)
                counted_BT = keep_BT
            else:
                keep_BT = m & (w_BT >= cfg.icepop_low) & (w_BT <= cfg.icepop_high)
            weight_BT = w_BT
            num_masked = (m.sum() - keep_BT.sum()).to(w_BT.dtype)
            metrics["is_masked_tokens"] = num_masked
            metrics["is_masked_frac"] = num_masked / m.sum().clamp(min=1)
        else:
            raise ValueError(f"algo.correction: unknown mode {cfg.correction!r}")
        weight_BT = torch.where(keep_BT, weight_BT, 0)
    return ISCorrection(weight=weight_BT, keep=keep_BT, counted=counted_BT, metrics=metrics)
