"""The KL reference on engines: a frozen reference pool prefills each finished sample (``max_new_tokens=0``,
input logprobs from the first response token on) and the logprobs go into ``Sample.ref_logprobs``; the batch
carries them to the loss as the KL term's ``ref_logp`` (``RLBatch.ref_logp``), and the trainer no longer swaps
reference weights in (``mrl.megatron.reference``).

It runs as a scorer so that it overlaps generation and the other scorers and inherits their fault handling: it
adds no reward (0), and a group whose reference could not be computed is dropped, counted, never trained
without it. The engine reads the sample's own tokens (prompt + response, observations of an episode included),
the tokens the trainer's KL is over; it routes them with the reference's own router (the trainer's swap
replays the rollout's routes through the reference weights).
"""

from __future__ import annotations

import asyncio

from mrl.config.scoring import ReferenceConfig
from mrl.scoring.base import GroupScores, NoScoringEngine, ScoringError, ScoringGroup
from mrl.scoring.model_scorer import PooledScorer
from mrl.scoring.pool import ScoringPool
from mrl.sglang.protocol import EngineHTTPError


class ReferenceScorer(PooledScorer):
    """Fills each sample's ``ref_logprobs`` from the reference pool; rewards 0 (see the module docstring)."""

    name = "reference"

    def __init__(self, cfg: ReferenceConfig, pool: ScoringPool):
        super().__init__(cfg, pool)
        self.cfg: ReferenceConfig = cfg

    async def _one(self, s) -> list[float]:
        if not s.response_ids:
            return []
        return await self.pool.input_logprobs(s.tokens, start=len(s.prompt_ids), rid=f"ref-g{s.group_id}-s{s.index}")

    async def score(self, group: ScoringGroup) -> GroupScores:
        self.groups += 1
        try:
            ref = await asyncio.gather(*(self._one(s) for s in group.samples))
        except NoScoringEngine:
            raise
        except (ScoringError, EngineHTTPError) as e:
            return self._failed(group, f"{type(e).__name__}: {e}")
        self._scored()
        for s, lp in zip(group.samples, ref):
            s.ref_logprobs = lp
        return GroupScores(rewards=[0.0] * len(group))
