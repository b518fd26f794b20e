"""A process reward model (PRM) on engines: each step of a response gets the PRM's verdict, as a token reward on
the step's last token.

Steps: a step ends where ``separator`` ends in a model turn (the token holding its last character), and every
model turn ends one (a multi-turn episode's turns are steps; observations are never scored). The PRM is
generative (Math-Shepherd, RLHFlow style): it reads the prompt and the response with ``step_tag`` inserted after
each step, and at the position after step k (after its tag) its next-token distribution gives

    p_k = P(good_token) / (P(good_token) + P(bad_token))

All of a sample's steps come from one engine call: SGLang's ``token_ids_logprob`` returns the two verdict
tokens' logprobs at every input position and at the one generated token (``ScoringPool.candidate_logprobs``).
Step k's reward ``weight * (p_k - baseline)`` goes on its last response token; the sample's scalar reward is 0
(the outcome reward comes from ``reward.fn``). With ``algo.token_reward_discount=1`` each token's advantage
gets the reward-to-go of the steps from its own on, as PRIME's process rewards (``mrl.algo.token_advantages``).

A group the pool cannot score is dropped, counted (``mrl.scoring.failures``).
"""

from __future__ import annotations

import asyncio
import math
import os
from typing import Callable

from mrl.config.scoring import PRMConfig
from mrl.scoring.base import GroupScores, NoScoringEngine, ScoringError, ScoringGroup
from mrl.scoring.model_scorer import PooledScorer
from mrl.scoring.pool import ScoringPool
from mrl.sglang.protocol import EngineHTTPError


def step_ends(response_ids: list[int], turns: list[tuple[int, int]], piece: Callable[[int], str],
              separator: str) -> list[int]:
    """Exclusive ends (response positions) of the steps: after each token that completes ``separator`` inside a
    model turn, and at each turn's end. ``piece(id)``: a token's text."""
    ends: list[int] = []
    for a, b in turns:
        if separator:
            text, owner = [], []  # owner[c]: the token holding character c of the turn's text
            for t in range(a, b):
                p = piece(response_ids[t])
                text.append(p)
                owner += [t] * len(p)
            turn = "".join(text)
            at = turn.find(separator)
            while at >= 0:
                e = owner[at + len(separator) - 1] + 1
                if not ends or ends[-1] < e:
                    ends.append(e)
                at = turn.find(separator, at + len(separator))
        if b > a and (not ends or ends[-1] < b):
            ends.append(b)
    return ends


def prm_input(prompt_ids: list[int], response_ids: list[int], ends: list[int],
              tag: list[int]) -> tuple[list[int], list[int]]:
    """What the PRM reads (prompt, then each step followed by ``tag``) and the positions where its verdict on
    each step is read (the position after the step's tag)."""
    ids, read, prev = list(prompt_ids), [], 0
    for e in ends:
        ids += response_ids[prev:e] + tag
        read.append(len(ids))
        prev = e
    return ids, read


def one_token(tokenizer, text: str, key: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    if len(ids) != 1:
        raise ValueError(f"scoring.prm.{key}={text!r} is {len(ids)} tokens of the PRM's tokenizer {ids}; a "
                         "verdict token must be one token")
    return ids[0]


class ProcessRewardScorer(PooledScorer):
    """Step rewards of a generative PRM as token rewards (see the module docstring)."""

    name = "prm"

    def __init__(self, cfg: PRMConfig, pool: ScoringPool, tokenizer=None):
        if tokenizer is None:
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(os.path.join(cfg.hf_path, "tokenizer.json"))
        super().__init__(cfg, pool)
        self.cfg: PRMConfig = cfg
        self.tok = tokenizer
        self.good, self.bad = one_token(tokenizer, cfg.good_token, "good_token"), one_token(tokenizer, cfg.bad_token,
                                                                                            "bad_token")
        self.tag = tokenizer.encode(cfg.step_tag, add_special_tokens=False).ids if cfg.step_tag else []
        self._pieces: dict[int, str] = {}
        self.steps = 0
        self.score_sum = 0.0

    def piece(self, token: int) -> str:
        if token not in self._pieces:
            self._pieces[token] = self.tok.decode([token], skip_special_tokens=False)
        return self._pieces[token]

    def steps_of(self, group: ScoringGroup, i: int) -> list[int]:
        s = group.samples[i]
        return step_ends(list(s.response_ids), group.turns(i), self.piece, self.cfg.separator)

    async def step_scores(self, prompt_ids: list[int], response_ids: list[int], ends: list[int],
                          rid: str) -> list[float]:
        """p_good of each step (ends: ``step_ends``'s) from one engine call."""
        if not ends:
            return []
        ids, read = prm_input(prompt_ids, response_ids, ends, self.tag)
        got = await self.pool.candidate_logprobs(ids, start=read[0], candidates=[self.good, self.bad], rid=rid)
        out = []
        for r in read:
            lp = got[r - read[0]]
            out.append(1.0 / (1.0 + math.exp(lp[self.bad] - lp[self.good])))
        return out

    async def score(self, group: ScoringGroup) -> GroupScores:
        self.groups += 1
        ends = [self.steps_of(group, i) for i in range(len(group))]
        try:
            scores = await asyncio.gather(*(
                self.step_scores(list(s.prompt_ids), list(s.response_ids), e, rid=f"prm-g{s.group_id}-s{s.index}")
                for s, e in zip(group.samples, ends)))
        except NoScoringEngine:
            raise
        except (ScoringError, EngineHTTPError) as e:
            return self._failed(group, f"{type(e).__name__}: {e}")
        self._scored()
        token = []
        for s, e, ps in zip(group.samples, ends, scores):
            tr = [0.0] * len(s.response_ids)
            for end, p in zip(e, ps):
                tr[end - 1] += self.cfg.weight * (p - self.cfg.baseline)
            token.append(tr)
            self.steps += len(ps)
            self.score_sum += sum(ps)
        return GroupScores(rewards=[0.0] * len(group), token_rewards=token)

    def stats(self) -> dict[str, float]:
        return {**super().stats(), "steps": float(self.steps), "step_score_mean": self.score_sum / max(self.steps, 1)}
