"""Scorers made of scorers: a weighted sum, and a gate (a rule check that zeroes another scorer's score).

    WeightedSum([(RuleScorer(rewards), 1.0), (judge, 0.5)])
    Gate(check=RuleScorer(format_ok), scorer=judge, threshold=1.0)   # the judge counts only where the check passes

Parts run concurrently. A sample one part drops (reward None) is dropped; token rewards are summed with
the same weights, a part without token rewards counting 0 at every token.
"""

from __future__ import annotations

import asyncio

from mrl.scoring.base import GroupScores, Scorer, ScoringGroup


def _errors(scores: list[GroupScores], n: int) -> list[str | None]:
    out = []
    for i in range(n):
        msgs = [s.errors[i] for s in scores if s.errors and s.errors[i]]
        out.append("; ".join(msgs) if msgs else None)
    return out


class WeightedSum(Scorer):
    """``sum_k w_k * score_k`` per sample and per token."""

    name = "sum"

    def __init__(self, parts: list[tuple[Scorer, float]]):
        if not parts:
            raise ValueError("WeightedSum: no scorer to sum")
        self.parts = parts

    async def score(self, group: ScoringGroup) -> GroupScores:
        scores = await asyncio.gather(*(s.score(group) for s, _ in self.parts))
        scores = [sc.check(group, s.name) for sc, (s, _) in zip(scores, self.parts)]
        n = len(group)
        rewards: list[float | None] = []
        for i in range(n):
            vals = [sc.rewards[i] for sc in scores]
            rewards.append(None if any(v is None for v in vals)
                           else sum(w * v for (_, w), v in zip(self.parts, vals)))
        token = None
        if any(sc.token_rewards is not None for sc in scores):
            token = [[0.0] * len(s.response_ids) for s in group.samples]
            for sc, (_, w) in zip(scores, self.parts):
                if sc.token_rewards is not None:
                    for acc, tr in zip(token, sc.token_rewards):
                        for t, r in enumerate(tr):
                            acc[t] += w * r
        return GroupScores(rewards=rewards, token_rewards=token, errors=_errors(scores, n))

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for s, _ in self.parts:
            out |= {f"{s.name}_{k}": v for k, v in s.stats().items()}
        return out

    async def aclose(self) -> None:
        for s, _ in self.parts:
            await s.aclose()

    def close(self) -> None:
        for s, _ in self.parts:
            s.close()


class Gate(Scorer):
    """``scorer``'s score where ``check``'s reward is at least ``threshold``, 0 (rewards and token rewards)
    elsewhere: e.g. a model judge that counts only for answers a rule finds well-formed. The check's own
    reward is not added (compose it in a ``WeightedSum`` for that)."""

    def __init__(self, check: Scorer, scorer: Scorer, threshold: float = 1.0):
        self.check_scorer, self.scorer, self.threshold = check, scorer, threshold
        self.name = f"gated_{scorer.name}"
        self.closed_gates = 0

    async def score(self, group: ScoringGroup) -> GroupScores:
        gate, inner = await asyncio.gather(self.check_scorer.score(group), self.scorer.score(group))
        gate, inner = gate.check(group, self.check_scorer.name), inner.check(group, self.scorer.name)
        rewards: list[float | None] = []
        token = None if inner.token_rewards is None else [list(tr) for tr in inner.token_rewards]
        for i, (g, r) in enumerate(zip(gate.rewards, inner.rewards)):
            if g is None or r is None:
                rewards.append(None)
                continue
            opened = g >= self.threshold
            self.closed_gates += not opened
            rewards.append(r if opened else 0.0)
            if token is not None and not opened:
                token[i] = [0.0] * len(token[i])
        return GroupScores(rewards=rewards, token_rewards=token, errors=_errors([gate, inner], len(group)))

    def stats(self) -> dict[str, float]:
        return {"closed_gates": float(self.closed_gates), **self.scorer.stats()}

    async def aclose(self) -> None:
        await self.check_scorer.aclose()
        await self.scorer.aclose()

    def close(self) -> None:
        self.check_scorer.close()
        self.scorer.close()
