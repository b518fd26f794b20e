"""Held-out evaluation sets (``train.eval_sets``), measured on the rollout engines while training goes on
(``mrl.rollout.evaluation``; docs/evaluation.md)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from mrl.config.base import fail

HELDOUT = "heldout"
"""``source`` of the run's own held-out prompts: ``data.eval_path``, or a built-in task's held-out inputs."""
SET_NAME = re.compile(r"[A-Za-z0-9_.-]+")
"""A set's name goes into metric names (``eval/<name>/pass_at_4``), which every tracker must accept."""


@dataclass(kw_only=True)
class EvalSetConfig:
    """One held-out set: greedy pass@1 and/or sampled pass@k (n completions per prompt, the unbiased
    estimator of Chen et al. 2021) on its first ``max_prompts`` prompts."""

    name: str = HELDOUT
    """Metric names ``eval/<name>/...``; unique among the sets."""
    source: str = HELDOUT
    """``heldout``: the run's held-out split (``data.eval_path``, or the task's held-out inputs); else a JSONL
    file of prompts, read with the run's ``data.prompt_key`` / ``answer_key`` / ``id_key``."""
    max_prompts: int = 32
    """Prompts evaluated (the set's first ones; fewer when the set has fewer)."""
    greedy: bool = True
    """Greedy pass@1: one temperature-0 completion per prompt (``eval/<name>/greedy_pass_at_1``)."""
    n: int = 0
    """Sampled completions per prompt for pass@k (0: none)."""
    k: list[int] = field(default_factory=lambda: [1])
    """pass@k reported for each k (each <= n): ``eval/<name>/pass_at_<k>``."""
    temperature: float = 1.0
    """Sampling temperature of the n completions."""
    top_p: float = 1.0
    max_new_tokens: Optional[int] = None
    """Completion budget; null: ``rollout.max_new_tokens`` (a JSONL row's own budget wins)."""
    threshold: float = 1.0
    """A completion is correct when its reward (``reward.fn``, or a multi-turn environment's) is at least this."""

    def __post_init__(self) -> None:
        key = f"train.eval_sets[{self.name}]"
        if not SET_NAME.fullmatch(self.name or ""):
            fail(f"{key}.name", "must be letters, digits, '_', '.' or '-' (it names the set's metrics)")
        if not self.source:
            fail(f"{key}.source", f"must be '{HELDOUT}' (the run's held-out split) or a JSONL file path")
        if self.max_prompts < 1:
            fail(f"{key}.max_prompts", f"must be >= 1, got {self.max_prompts}")
        if self.n < 0:
            fail(f"{key}.n", f"must be >= 0 (0: no sampled completions), got {self.n}")
        if not self.greedy and self.n == 0:
            fail(key, "measures nothing: set greedy=true or n > 0")
        if self.n:
            if not self.k or len(set(self.k)) != len(self.k) or not all(1 <= k <= self.n for k in self.k):
                fail(f"{key}.k", f"must be distinct values in [1, n={self.n}], got {list(self.k)}")
            if not self.temperature > 0:
                fail(f"{key}.temperature", f"must be > 0 for sampled completions (greedy=true gives the "
                     f"temperature-0 one), got {self.temperature}")
            if not 0.0 < self.top_p <= 1.0:
                fail(f"{key}.top_p", f"must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            fail(f"{key}.max_new_tokens", f"must be >= 1 or null, got {self.max_new_tokens}")


def check_eval_sets(sets: list[EvalSetConfig]) -> None:
    names = [s.name for s in sets]
    if dup := sorted({n for n in names if names.count(n) > 1}):
        fail("train.eval_sets", f"set names must be unique, {dup} repeat")
