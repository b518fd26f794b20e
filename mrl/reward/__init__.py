"""Rewards: fns by dotted path (``reward.fn``), scored asynchronously by ``RewardScorer``.

A reward fn is ``fn(prompt: Prompt, response_text: str) -> float`` or the same as ``async def``;
see ``mrl.reward.builtin`` for the contract and the built-ins.
"""

from mrl.reward.scorer import RewardError, RewardResult, RewardScorer, load_reward_fn

__all__ = ["RewardError", "RewardResult", "RewardScorer", "load_reward_fn"]
