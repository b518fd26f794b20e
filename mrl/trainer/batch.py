"""A step's batch from its groups: advantages per group, the loss normalizer and the reward figures (and the
reference engines' logprobs of the KL term, with ``scoring.reference``)."""

from __future__ import annotations

import torch

from mrl.algo import compute_advantages, loss_normalizer, overlong_penalty, token_advantages
from mrl.config.schema import Config
from mrl.megatron.policy import RLBatch
from mrl.rollout.buffer import Group


def build_batch(groups: list[Group], cfg: Config, with_routes: bool) -> tuple[RLBatch, float, dict]:
    """Advantages per group (+ DAPO overlong shaping), flattened in group order; per token when a group
    carries token rewards (``mrl.algo.token_advantages``; groups without count 0 at every token)."""
    n = cfg.rollout.n_samples_per_prompt
    rewards = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float32)
    samples = [s for g in groups for s in g.samples]
    if cfg.algo.overlong_shaping:
        lengths = torch.tensor([len(s.response_ids) for s in samples])
        rewards = rewards + overlong_penalty(lengths, max_len=cfg.algo.max_response_len,
                                             buffer_len=cfg.algo.overlong_buffer_len)
    sizes = [len(g.rewards) for g in groups]  # whole groups today; each normalized by its own size regardless
    adv = (compute_advantages(rewards, n, cfg.algo) if set(sizes) == {n}
           else torch.cat([compute_advantages(r, len(r), cfg.algo) for r in rewards.split(sizes)]))
    token_adv, token_info = None, {}
    if any(g.token_rewards is not None for g in groups):
        token_rewards = [tr for g in groups for tr in (g.token_rewards or [[0.0] * len(s.response_ids)
                                                                           for s in g.samples])]
        token_adv = token_advantages(adv, token_rewards, discount=cfg.algo.token_reward_discount,
                                     loss_masks=[list(s.loss_mask) for s in samples])
        trained = [r for s, tr in zip(samples, token_rewards) for m, r in zip(s.loss_mask or [1] * len(tr), tr) if m]
        token_info = {"token_reward": sum(trained) / max(len(trained), 1)}
    batch = RLBatch(tokens=[s.tokens for s in samples], prompt_lens=[len(s.prompt_ids) for s in samples],
                    behav_logp=[list(s.response_logprobs) for s in samples], advantages=adv.tolist(),
                    routes=[s.routes for s in samples] if with_routes else None,
                    support=[s.support for s in samples] if cfg.train.sampling_mask else None,
                    support_log_mass=[s.support_log_mass for s in samples] if cfg.train.sampling_mask else None,
                    # multi-turn episodes: observation tokens (mask 0) are context, never trained
                    loss_mask=[list(s.loss_mask) or [1] * len(s.response_ids) for s in samples]
                    if any(0 in s.loss_mask for s in samples) else None,
                    versions=[list(s.versions) for s in samples], token_advantages=token_adv,
                    ref_logp=_ref_logprobs(samples) if cfg.scoring.reference.enabled else None)
    masks = torch.zeros(len(samples), max(len(t) for t in batch.tokens))
    for i, s in enumerate(samples):  # the normalizer counts trained tokens only (token-mean aggregations)
        masks[i, :len(s.response_ids)] = torch.tensor(s.loss_mask, dtype=torch.float32) if s.loss_mask else 1
    raw = [r for g in groups for r in g.rewards]
    info = {"reward": sum(raw) / len(raw), "success": sum(r >= 1.0 for r in raw) / len(raw),
            "response_len": sum(len(s.response_ids) for s in samples) / len(samples),
            "groups_without_signal": float(sum(max(g.rewards) == min(g.rewards) for g in groups)),
            "batch_tokens": float(sum(len(s.tokens) for s in samples)),  # prompt + response: what the step trains on
            **token_info}
    return batch, float(loss_normalizer(masks, cfg.algo.aggregation)), info


def _ref_logprobs(samples) -> list[list[float]]:
    """The reference engines' logprobs of every sample (``scoring.reference``): a sample without them is never
    trained (the reference scorer drops the groups it could not score)."""
    for s in samples:
        if len(s.ref_logprobs) != len(s.response_ids):
            raise ValueError(f"scoring.reference: sample {s.index} of group {s.group_id} has {len(s.ref_logprobs)} "
                             f"reference logprobs for {len(s.response_ids)} response tokens")
    return [list(s.ref_logprobs) for s in samples]
