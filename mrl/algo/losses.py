"""Clipped policy-gradient losses (GRPO / DAPO / GSPO) and the single entry the trainer calls.

Shapes: B sequences, T padded response tokens. ``mask`` [B, T] (bool or 0/1) is true on response
tokens; masked positions may hold anything (padding logprobs of -inf included) and get exactly zero
gradient. Logprobs: ``logp`` current policy pi (requires grad), ``old_logp`` trainer recompute pi_old,
``behav_logp`` engine (behaviour) policy pi_behav; see ``mrl.algo.correction``.
"""

from __future__ import annotations

import torch

from mrl.algo.aggregation import aggregate, loss_normalizer, masked_mean
from mrl.algo.correction import importance_correction
from mrl.algo.kl import kl_penalty
from mrl.config.schema import AlgoConfig, Correction, LossType, OldLogprobs

_MAX_LOG_RATIO = 20.0  # keeps exp() finite; a ratio of e^20 is far outside any clip range


def token_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log(pi / pi_old) per token; 0 on masked positions."""
    return torch.where(mask.bool(), logp - old_logp, 0)


def sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO-token: value log s_i on every token of sequence i, gradient that of log pi(y_t).

    s_i = exp(mean_t log(pi / pi_old)) over the sequence's response tokens. The token term is
    logp_t - sg(logp_t) + sg(log s_i), so exp() of it equals s_i and its gradient is s_i * grad logp_t;
    averaged over the sequence's tokens (seq_mean_token_mean) that is exactly grad s_i (GSPO eq. 11).
    """
    m = mask.bool()
    logp = torch.where(m, logp, 0)
    log_s_B = masked_mean(logp - old_logp, m, dim=-1)
    return torch.where(m, logp - logp.detach() + log_s_B.detach()[:, None], 0)


def clipped_surrogate(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss ``-min(r*A, clip(r, 1-clip_low, 1+clip_high)*A)`` and the ratio r.

    Where the clipped term wins (r > 1+clip_high with A > 0, r < 1-clip_low with A < 0) the gradient
    is zero. ``dual_clip`` c caps the loss at -c*A for A < 0 (Ye et al. 2020), bounding huge ratios.
    """
    ratio = log_ratio.clamp(max=_MAX_LOG_RATIO).exp()
    loss = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high))
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * dual_clip), loss)
    return loss, ratio


def compute_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: AlgoConfig,
    ref_logp: torch.Tensor | None = None,
    normalizer: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy loss of every algorithm: clipped surrogate x IS correction, aggregated, + kl_coef * KL.

    ``advantages`` is [B] (one per sequence) or [B, T]. ``normalizer``: the global normalizer of
    ``cfg.aggregation`` (sum of ``loss_normalizer`` over all micro-batches and DP ranks, without the
    sequences masked IS rejects); None = this batch's own. With the global one, summing the returned
    loss over micro-batches (and DP ranks) gives the full-batch loss; a DP gradient all-reduce that
    averages must be scaled back by the DP size.
    Metrics are detached 0-dim tensors, means over this batch's response tokens.
    """
    m = mask.bool()
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logp)
    advantages = torch.where(m, advantages, 0)
    tok_log_ratio = token_log_ratio(logp, old_logp, m)
    log_ratio = sequence_log_ratio(logp, old_logp, m) if cfg.loss is LossType.gspo else tok_log_ratio
    pg_BT, ratio = clipped_surrogate(
        log_ratio, advantages, clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip
    )
    corr = importance_correction(old_logp, behav_logp, m, cfg)
    if normalizer is None:  # sequences masked IS rejects leave it
        normalizer = loss_normalizer(corr.counted, cfg.aggregation)
    agg = dict(normalizer=normalizer, max_response_len=cfg.max_response_len)
    pg_loss = aggregate(pg_BT * corr.weight, m, cfg.aggregation, **agg)
    loss = pg_loss

    metrics = {"pg_loss": pg_loss.detach()}
    if cfg.kl_coef > 0:
        if ref_logp is None:
            raise ValueError(f"algo.kl_coef: is {cfg.kl_coef} > 0 but no ref_logp was given")
        kl_BT = kl_penalty(torch.where(m, logp, 0), torch.where(m, ref_logp, 0), cfg.kl_estimator)
        kl_loss = aggregate(kl_BT, corr.counted, cfg.aggregation, **agg)
        loss = loss + cfg.kl_coef * kl_loss
        metrics["kl_ref"] = kl_loss.detach()
    with torch.no_grad():
        metrics |= _ratio_metrics(ratio, tok_log_ratio, advantages, m, cfg)
    metrics |= corr.metrics
    return loss, metrics


def _ratio_metrics(
    ratio: torch.Tensor, tok_log_ratio: torch.Tensor, advantages: torch.Tensor, m: torch.Tensor, cfg: AlgoConfig
) -> dict[str, torch.Tensor]:
    """Clip fractions (where the clipped term is active), mean ratio, approx KL(pi_old || pi) (k3)."""
    out = {
        "ratio_mean": masked_mean(ratio, m),
        "clip_frac_low": masked_mean(((ratio < 1.0 - cfg.clip_low) & (advantages < 0)).to(ratio.dtype), m),
        "clip_frac_high": masked_mean(((ratio > 1.0 + cfg.clip_high) & (advantages > 0)).to(ratio.dtype), m),
        "approx_kl": masked_mean(tok_log_ratio.exp() - 1.0 - tok_log_ratio, m),
    }
    if cfg.dual_clip is not None:
        out["dual_clip_frac"] = masked_mean(((ratio > cfg.dual_clip) & (advantages < 0)).to(ratio.dtype), m)
    return out


def describe_update(cfg: AlgoConfig) -> str:
    """One line for the start of a run: how many optimizer steps a rollout batch feeds, which policy the
    ratio is clipped against, and whether the clip can act at all (one step against the recomputed policy:
    the ratio is exactly 1 and only the correction bounds the update)."""
    steps = cfg.mini_batches * cfg.ppo_epochs
    ratio = "sequence ratio (geometric mean)" if cfg.loss is LossType.gspo else "token ratio"
    head = (f"policy loss: {cfg.loss.value}, {steps} optimizer step(s) per rollout batch "
            f"(algo.mini_batches={cfg.mini_batches} x algo.ppo_epochs={cfg.ppo_epochs}), {ratio} clipped to "
            f"[1-{cfg.clip_low:g}, 1+{cfg.clip_high:g}]")
    corr = "no correction" if cfg.correction is Correction.none else \
        f"correction={cfg.correction.value} ({cfg.correction_level.value}) of pi_old/pi_engine"
    if cfg.old_logprobs is OldLogprobs.engine:
        return f"{head} against the engine's policy; {corr}"
    if steps == 1:
        return (f"{head} against the recomputed policy: with one step the ratio is exactly 1, so clip_low/clip_high"
                f"{'/dual_clip' if cfg.dual_clip is not None else ''} do not act; the update is bounded by the "
                f"{corr} alone (algo.mini_batches > 1 or algo.ppo_epochs > 1 lets the clip act)")
    return f"{head} against the policy recomputed before the first step (decoupled PPO: {corr})"
