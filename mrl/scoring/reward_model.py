"""A reward model: a ``*ForSequenceClassification`` / ``*ForRewardModel`` checkpoint served by SGLang's
classification path (``--is-embedding``, ``/classify``) scores each sample; its score is the reward.

Each sample is rendered as a user message (the prompt's text) and an assistant message (the sample's text) with
the reward model tokenizer's chat template when it has one, or as the plain text prompt + response otherwise;
the engine's score at the last token (label 0) gives ``reward = scale * (score - shift)``. Every sample of a
group is scored at once; a group the pool cannot score is dropped, counted (``mrl.scoring.model_scorer``).
"""

from __future__ import annotations

import asyncio

from mrl.config.scoring import RewardModelConfig
from mrl.scoring.base import GroupScores, NoScoringEngine, ScoringError, ScoringGroup
from mrl.scoring.model_scorer import PooledScorer, ScorerTokenizer
from mrl.scoring.pool import ScoringPool
from mrl.sglang.protocol import EngineHTTPError


class RewardModelScorer(PooledScorer):
    """Each sample's reward from a reward model engine (see the module docstring)."""

    name = "reward_model"

    def __init__(self, cfg: RewardModelConfig, pool: ScoringPool, tokenizer: ScorerTokenizer | None = None):
        super().__init__(cfg, pool)
        self.cfg: RewardModelConfig = cfg
        self.tok = tokenizer or ScorerTokenizer(cfg.hf_path, chat_template=cfg.chat_template)

    def input_ids(self, prompt: str, response: str) -> list[int]:
        """The token ids the reward model scores for ``response`` to ``prompt``."""
        return self.tok.encode_messages([{"role": "user", "content": prompt},
                                         {"role": "assistant", "content": response}], generation_prompt=False)

    async def score(self, group: ScoringGroup) -> GroupScores:
        self.groups += 1
        try:
            scores = await asyncio.gather(*(
                self.pool.classify(self.input_ids(group.prompt.text, text),
                                   rid=f"rm-g{getattr(s, 'group_id', group.prompt.id)}-s{getattr(s, 'index', i)}")
                for i, (s, text) in enumerate(zip(group.samples, group.texts))))
        except NoScoringEngine:
            raise
        except (ScoringError, EngineHTTPError) as e:
            return self._failed(group, f"{type(e).__name__}: {e}")
        self._scored()
        return GroupScores(rewards=[self.cfg.scale * (s[0] - self.cfg.shift) for s in scores])
