"""The simplest scorers: ``reward.fn`` on each response (``RuleScorer``), and a multi-turn environment's own
reward (``EnvScorer``)."""

from __future__ import annotations

from mrl.reward.scorer import RewardScorer
from mrl.scoring.base import GroupScores, Scorer, ScoringGroup


class RuleScorer(Scorer):
    """``reward.fn(prompt, response_text)`` per sample, through ``RewardScorer``: its workers, timeouts,
    ``on_error`` and error-rate limit as they are (a dropped reward drops the group)."""

    name = "reward"

    def __init__(self, rewards: RewardScorer):
        self.rewards = rewards

    async def score(self, group: ScoringGroup) -> GroupScores:
        results = await self.rewards.score_many([(group.prompt, t) for t in group.texts])
        return GroupScores(rewards=[r.value for r in results], errors=[r.error for r in results])

    def stats(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.rewards.stats.items()}


class EnvScorer(Scorer):
    """A multi-turn episode's reward: the sum of its environment's step rewards (``Sample.reward``)."""

    name = "env"

    async def score(self, group: ScoringGroup) -> GroupScores:
        return GroupScores(rewards=[float(s.reward) for s in group.samples])
