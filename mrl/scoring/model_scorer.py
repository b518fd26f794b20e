"""What the scorers that call a model on engines of their own share: the failure accounting of their pool
(``PooledScorer``: the teacher, the KL reference, the PRM, the judge, the reward model) and, for those that
build a text for the model (the judge, the reward model), its tokenizer, which turns the text into the
engine's token ids.

    tok = ScorerTokenizer(cfg.hf_path, chat_template=cfg.chat_template)
    ids = tok.encode_messages([{"role": "user", "content": text}], generation_prompt=True)

A group the pool cannot score (its calls failed on every engine they were moved to), or whose samples the
scorer could not score at all, is dropped, counted, never trained on a made-up score; more than
``max_error_rate`` of the last 64 groups failing stops the run.
"""

from __future__ import annotations

import logging
from typing import Any

from mrl.config.scoring import EnginePoolConfig
from mrl.scoring.base import GroupScores, Scorer, ScoringGroup
from mrl.scoring.failures import FailedGroups
from mrl.scoring.pool import ScoringPool

logger = logging.getLogger(__name__)


class ScorerTokenizer:
    """A scoring model's tokenizer: transformers' when the checkpoint has a chat template (and ``chat_template``),
    which then renders the messages; otherwise the checkpoint's ``tokenizer.json``, the messages' contents joined
    and encoded with the tokenizer's special tokens (as the rollout encodes plain prompts)."""

    def __init__(self, model_dir: str, *, chat_template: bool = True):
        from mrl.data.hf_files import has_chat_template

        self.templated = chat_template and has_chat_template(model_dir)
        if self.templated:
            from transformers import AutoTokenizer

            self.tok: Any = AutoTokenizer.from_pretrained(model_dir)
        else:
            from mrl.data.prompt import load_tokenizer

            self.tok = load_tokenizer(model_dir)

    def encode_messages(self, messages: list[dict[str, str]], *, generation_prompt: bool) -> list[int]:
        if self.templated:
            text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
            return list(self.tok.encode(text, add_special_tokens=False))
        return list(self.tok.encode("".join(m["content"] for m in messages)).ids)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)


class PooledScorer(Scorer):
    """A scorer whose model runs on a ``ScoringPool``: counts its groups, drops the failed ones and stops the run
    past ``cfg.max_error_rate``; closes the pool."""

    def __init__(self, cfg: EnginePoolConfig, pool: ScoringPool):
        self.cfg, self.pool = cfg, pool
        self.failures = FailedGroups(cfg.NODE, cfg.max_error_rate)
        self.groups = 0

    @property
    def failed(self) -> int:
        return self.failures.failed

    def _scored(self) -> None:
        self.failures.ok()

    def _failed(self, group: ScoringGroup, why: str) -> GroupScores:
        """A group that could not be scored: dropped, counted."""
        return self.failures.dropped(group, why)

    def _count_failure(self, group: ScoringGroup, why: str) -> None:
        """Count a group that is dropped; past ``max_error_rate`` of the last groups the run stops."""
        self.failures.dropped(group, why)

    def stats(self) -> dict[str, float]:
        return {"groups": float(self.groups), "groups_failed": float(self.failed), **self.pool.stats()}

    async def aclose(self) -> None:
        await self.pool.aclose()

    def close(self) -> None:
        self.pool.close()
