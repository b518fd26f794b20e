"""Group scorers for the scoring tests (loaded by dotted path, as a user's would be)."""

from __future__ import annotations

import asyncio

from mrl.scoring import GroupScores, Scorer, ScoringGroup


class Length(Scorer):
    """Reward = response length in tokens times ``scale``; token rewards = ``per_token`` at each model token."""

    name = "length"

    def __init__(self, scale: float = 1.0, per_token: float | None = None):
        self.scale, self.per_token = scale, per_token

    async def score(self, group: ScoringGroup) -> GroupScores:
        await asyncio.sleep(0)
        token = None if self.per_token is None else [
            [self.per_token * m for m in (s.loss_mask or [1] * len(s.response_ids))] for s in group.samples]
        return GroupScores(rewards=[self.scale * len(s.response_ids) for s in group.samples], token_rewards=token)


class DropsFirst(Scorer):
    """Drops sample 0 of every group (reward None)."""

    async def score(self, group: ScoringGroup) -> GroupScores:
        rest = len(group) - 1
        return GroupScores(rewards=[None] + [1.0] * rest, errors=["judge said no"] + [None] * rest)


class NotAScorer:
    pass
