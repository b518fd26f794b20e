"""A generative judge: a model on engines of its own reads each sample and writes a verdict, which becomes the reward.

For each sample of a group, all at once:

1. ``scoring.judge.template`` is filled with the prompt's text (``{prompt}``), the sample's text
   (``{response}``) and the prompt's reference answer (``{answer}``), rendered as one user message with the
   judge tokenizer's chat template when it has one, and sent to the judge pool (``ScoringPool.generate``);
2. the first match of ``verdict_regex`` in the judge's text gives the verdict (its first capture group):
   looked up in ``verdicts`` (lowercased), or, with ``verdicts`` null, read as a number in ``score_range``
   and scaled to [0, 1];
3. a verdict that does not parse is asked again (``parse_retries`` times, at ``retry_temperature``: a greedy
   verdict would come out the same), counted; one that never parses gets ``fallback`` (counted as a reward
   error) or, with no fallback, drops its group: no sample is trained on a made-up score.

Dropped groups count towards ``max_error_rate`` as failed calls do, so a judge whose verdicts never parse stops
the run instead of dropping every group.
"""

from __future__ import annotations

import asyncio
import re

from mrl.config.scoring import JudgeConfig
from mrl.scoring.base import GroupScores, NoScoringEngine, ScoringError, ScoringGroup
from mrl.scoring.model_scorer import PooledScorer, ScorerTokenizer
from mrl.scoring.pool import ScoringPool
from mrl.sglang.protocol import EngineHTTPError


def render(template: str, *, prompt: str, response: str, answer: str) -> str:
    """``template`` with its ``{prompt}``, ``{response}`` and ``{answer}`` filled in."""
    return template.format(prompt=prompt, response=response, answer=answer)


def parse_verdict(text: str, pattern: re.Pattern, verdicts: dict[str, float] | None,
                  score_range: list[float]) -> float | None:
    """The reward the judge's ``text`` gives, or None when it holds no verdict ``pattern`` and ``verdicts`` (or,
    with ``verdicts`` None, ``score_range``) accept."""
    m = pattern.search(text)
    if m is None or m.group(1) is None:
        return None
    got = m.group(1).strip()
    if verdicts is not None:
        return verdicts.get(got.lower())
    try:
        x = float(got)
    except ValueError:
        return None
    lo, hi = score_range
    return (x - lo) / (hi - lo) if lo <= x <= hi else None


class JudgeScorer(PooledScorer):
    """Each sample's reward from the judge's verdict (see the module docstring)."""

    name = "judge"

    def __init__(self, cfg: JudgeConfig, pool: ScoringPool, tokenizer: ScorerTokenizer | None = None):
        super().__init__(cfg, pool)
        self.cfg: JudgeConfig = cfg
        self.tok = tokenizer or ScorerTokenizer(cfg.hf_path, chat_template=cfg.chat_template)
        self.pattern = re.compile(cfg.verdict_regex)
        self.verdicts = None if cfg.verdicts is None else {k.lower(): float(v) for k, v in cfg.verdicts.items()}
        self.counts = {"verdicts": 0, "unparseable": 0, "fallbacks": 0, "groups_unparseable": 0}

    async def score(self, group: ScoringGroup) -> GroupScores:
        self.groups += 1
        try:
            judged = await asyncio.gather(*(self._judge(group, i) for i in range(len(group))))
        except NoScoringEngine:
            raise
        except (ScoringError, EngineHTTPError) as e:
            return self._failed(group, f"{type(e).__name__}: {e}")
        rewards = [r for r, _ in judged]
        errors = [why for _, why in judged]
        if any(r is None for r in rewards):
            self.counts["groups_unparseable"] += 1
            self._count_failure(group, next(w for w in errors if w))
        else:
            self._scored()
        return GroupScores(rewards=rewards, errors=errors)

    async def _judge(self, group: ScoringGroup, i: int) -> tuple[float | None, str | None]:
        """Sample ``i``'s reward, and why it is not a verdict of the judge's (a fallback or None)."""
        cfg, s = self.cfg, group.samples[i]
        text = render(cfg.template, prompt=group.prompt.text, response=group.texts[i], answer=group.prompt.answer)
        ids = self.tok.encode_messages([{"role": "user", "content": text}], generation_prompt=True)
        said = ""
        for attempt in range(cfg.parse_retries + 1):
            params = {"max_new_tokens": cfg.max_new_tokens, "top_p": cfg.top_p,
                      "temperature": cfg.temperature if attempt == 0 else cfg.retry_temperature}
            rid = f"judge-g{getattr(s, 'group_id', group.prompt.id)}-s{getattr(s, 'index', i)}-v{attempt}"
            out = await self.pool.generate(ids, params, rid=rid)
            said = self.tok.decode(out.output_ids)
            reward = parse_verdict(said, self.pattern, self.verdicts, cfg.score_range)
            if reward is not None:
                self.counts["verdicts"] += 1
                return reward, None
            self.counts["unparseable"] += 1
        why = f"judge: no verdict in {cfg.parse_retries + 1} attempts (last: {said[:80]!r})"
        if cfg.fallback is None:
            return None, why
        self.counts["fallbacks"] += 1
        return float(cfg.fallback), why

    def stats(self) -> dict[str, float]:
        return {**super().stats(), **{k: float(v) for k, v in self.counts.items()}}
