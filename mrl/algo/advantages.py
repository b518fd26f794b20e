"""Advantages from scalar rewards, per-token advantages from token rewards, and DAPO's reward-side helpers
(dynamic sampling, overlong shaping).

Rewards are flat ``[num_groups * group_size]`` in group order: group g is
``rewards[g * group_size:(g + 1) * group_size]`` (the samples of one prompt). Advantages come out per
sample; the caller broadcasts them over the sample's response tokens (the loss masks the rest).
"""

from __future__ import annotations

import torch

from mrl.config.schema import AdvEstimator, AlgoConfig


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 for a group baseline, got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be flat with a multiple of group_size={group_size} entries, "
                         f"got shape {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        rewards = rewards.float()
    return rewards.view(-1, group_size)


def group_advantages(
    rewards: torch.Tensor, group_size: int, *, std_normalize: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO: (r - group mean) / (group std + eps), std unbiased; ``std_normalize=False`` is Dr. GRPO."""
    r_GS = _grouped(rewards, group_size)
    adv_GS = r_GS - r_GS.mean(dim=1, keepdim=True)
    if std_normalize:
        adv_GS = adv_GS / (r_GS.std(dim=1, keepdim=True) + eps)
    return adv_GS.flatten()


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO: r_i minus the mean reward of the other group_size - 1 samples of its group."""
    r_GS = _grouped(rewards, group_size)
    others_mean_GS = (r_GS.sum(dim=1, keepdim=True) - r_GS) / (group_size - 1)
    return (r_GS - others_mean_GS).flatten()


def compute_advantages(rewards: torch.Tensor, group_size: int, cfg: AlgoConfig) -> torch.Tensor:
    """Per-sample advantages with the estimator of ``cfg.adv_estimator``."""
    if cfg.adv_estimator is AdvEstimator.grpo:
        return group_advantages(rewards, group_size, std_normalize=cfg.std_normalize, eps=cfg.adv_eps)
    if cfg.adv_estimator is AdvEstimator.rloo:
        return rloo_advantages(rewards, group_size)
    raise ValueError(f"algo.adv_estimator: unknown estimator {cfg.adv_estimator!r}")


def token_advantages(advantages: torch.Tensor, token_rewards: list[list[float]], *, discount: float = 0.0,
                     loss_masks: list[list[int]] | None = None) -> list[list[float]]:
    """Per-token advantages from per-sample advantages and per-token rewards (process rewards, a teacher's
    per-token reverse KL):

        A[i, t] = A[i] + G[i, t],   G[i, t] = m[i, t] * r[i, t] + discount * G[i, t + 1],   G[i, T_i] = 0

    i.e. A[i] (the estimator's advantage of the sample's scalar reward) plus the discounted sum of the
    token rewards from t on, over the sample's trained tokens (``m`` = loss mask, 1 where the model
    generated the token; an observation's reward counts 0 but still takes a discount step). ``discount=0``:
    each token's own reward (on-policy distillation: the reverse KL of that token); ``discount=1``: the
    reward-to-go (PRIME-style process rewards). Token rewards are not normalized by the group: their scale
    is the scorer's (weight it in the composition)."""
    if not 0.0 <= discount <= 1.0:
        raise ValueError(f"token reward discount must be in [0, 1], got {discount}")
    if len(token_rewards) != advantages.numel():
        raise ValueError(f"{len(token_rewards)} samples of token rewards for {advantages.numel()} advantages")
    out = []
    for i, (a, r) in enumerate(zip(advantages.tolist(), token_rewards)):
        m = loss_masks[i] if loss_masks is not None and loss_masks[i] else [1] * len(r)
        if len(m) != len(r):
            raise ValueError(f"sample {i}: {len(r)} token rewards for a loss mask of {len(m)} tokens")
        row, acc = [0.0] * len(r), 0.0
        for t in range(len(r) - 1, -1, -1):
            acc = m[t] * float(r[t]) + discount * acc
            row[t] = a + acc
        out.append(row)
    return out


def dynamic_sampling_mask(rewards: torch.Tensor, group_size: int) -> tuple[torch.Tensor, int]:
    """DAPO dynamic sampling: ``(keep [num_groups] bool, number dropped)``; a group whose rewards are
    all equal has zero advantage everywhere, so it carries no gradient signal and is dropped."""
    r_GS = _grouped(rewards, group_size)
    keep_G = r_GS.amax(dim=1) != r_GS.amin(dim=1)
    return keep_G, int((~keep_G).sum())


def overlong_penalty(lengths: torch.Tensor, *, max_len: int, buffer_len: int) -> torch.Tensor:
    """DAPO soft overlong punishment, added to the reward: 0 for L <= max_len - buffer_len, then linear
    ``(max_len - buffer_len - L) / buffer_len`` down to -1 at L = max_len, and -1 beyond."""
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"algo.overlong_buffer_len: must be in [1, {max_len}], got {buffer_len}")
    start = max_len - buffer_len
    return ((start - lengths.float()) / buffer_len).clamp(min=-1.0, max=0.0)
