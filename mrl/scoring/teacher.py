"""On-policy distillation: a teacher engine pool scores the student's sampled tokens.

For each sample, the teacher prefills prompt + response (``max_new_tokens=0``, input logprobs from the first
response token on) and each response token t the model generated gets the token reward

    r[t] = coef * clip(log p_teacher(y_t | y_<t) - log p_student(y_t | y_<t), -c, c)

the negative of the per-token reverse KL estimate KL(student || teacher) at the sampled token; the student's
logprob is the engine's that sampled it (``Sample.response_logprobs``). ``c`` is ``scoring.teacher.clip``
(null: no bound). An observation of a multi-turn
episode (loss mask 0) gets 0. The scalar reward is 0: the token rewards reach the advantage through
``mrl.algo.token_advantages`` (``algo.token_reward_discount=0``: each token's own).

A group the pool cannot score (its calls failed on every engine they were moved to) is dropped, counted,
never trained without its score; more than ``max_error_rate`` of the last 64 groups failing stops the run.
"""

from __future__ import annotations

import asyncio
import logging

from mrl.config.scoring import TeacherConfig
from mrl.scoring.base import GroupScores, NoScoringEngine, ScoringError, ScoringGroup
from mrl.scoring.model_scorer import PooledScorer
from mrl.scoring.pool import ScoringPool
from mrl.sglang.protocol import EngineHTTPError

logger = logging.getLogger(__name__)


def opd_token_rewards(teacher: list[float], student: list[float], mask: list[int], *, coef: float,
                      clip: float | None = None) -> list[float]:
    """One sample's token rewards (the module docstring's formula): 0 where ``mask`` is 0."""
    out = []
    for t, b, m in zip(teacher, student, mask):
        d = t - b
        if clip is not None:
            d = min(max(d, -clip), clip)
        out.append(coef * d if m else 0.0)
    return out


class TeacherScorer(PooledScorer):
    """Per-token reverse KL to a teacher (see the module docstring); scores every sample of a group at once."""

    name = "teacher"

    def __init__(self, cfg: TeacherConfig, pool: ScoringPool):
        super().__init__(cfg, pool)
        self.cfg: TeacherConfig = cfg

    async def score(self, group: ScoringGroup) -> GroupScores:
        self.groups += 1
        try:
            teacher = await asyncio.gather(*(
                self.pool.input_logprobs(s.tokens, start=len(s.prompt_ids), rid=f"opd-g{s.group_id}-s{s.index}")
                for s in group.samples))
        except NoScoringEngine:
            raise
        except (ScoringError, EngineHTTPError) as e:
            return self._failed(group, f"{type(e).__name__}: {e}")
        self._scored()
        token = []
        for s, t_lp in zip(group.samples, teacher):
            mask = list(s.loss_mask) or [1] * len(s.response_ids)
            token.append(opd_token_rewards(t_lp, s.response_logprobs, mask, coef=self.cfg.coef, clip=self.cfg.clip))
        return GroupScores(rewards=[0.0] * len(group), token_rewards=token)
