"""The ``scoring:`` node: which scorers turn a group of samples into rewards (``mrl.scoring``), and the teacher
engine pool of on-policy distillation. The default is ``reward.fn`` alone, as a run without this node."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from mrl.config.base import fail
from mrl.config.engine import EngineConfig


@dataclass(kw_only=True)
class ScorerSpec:
    """A group scorer of the user's: an ``mrl.scoring.Scorer`` subclass (or factory) by dotted path."""

    cls: str
    """Dotted path, e.g. ``my_pkg.scorers.LengthPenalty``."""
    weight: float = 1.0
    """Its weight in the sum of every scorer's reward (and token rewards)."""
    gated: bool = False
    """Count it only for samples whose ``reward.fn`` reward reaches ``scoring.gate_threshold`` (0 elsewhere)."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of ``cls``."""


@dataclass(kw_only=True)
class TeacherConfig:
    """On-policy distillation: teacher engines score the student's sampled tokens by prefill (no generation);
    each token's reward is ``coef * (teacher logprob - student logprob)``, the per-token reverse KL's negative."""

    hf_path: Optional[str] = None
    """The teacher's Hugging Face checkpoint (null: no teacher). It must share the student's tokenizer (the
    preflight compares them). With ``engine.urls`` it names the running teachers' checkpoint."""
    coef: float = 1.0
    """Weight of the per-token reverse KL in the advantage (slime's ``--opd-kl-coef``)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The teacher pool: the same keys as the rollout pool's ``engine:`` (count, cpus, server_args, urls,
    max_restarts, ...); ``url_dir`` and LoRA keys do not apply."""
    timeout_s: float = 120.0
    """Limit of one scoring call; an engine that passes it and fails its liveness probe is replaced."""
    max_retries: int = 3
    """A group's scoring moves to another teacher engine at most this many times before it is dropped."""
    max_error_rate: float = 0.5
    """The run stops once more than this share of the last 64 groups could not be scored."""
    health_timeout_s: float = 600.0
    """How long a teacher engine (or its replacement) may take to become healthy."""

    @property
    def enabled(self) -> bool:
        return self.hf_path is not None

    def __post_init__(self) -> None:
        if self.coef <= 0.0:
            fail("scoring.teacher.coef", f"must be > 0, got {self.coef}")
        if not self.timeout_s > 0:
            fail("scoring.teacher.timeout_s", f"must be > 0, got {self.timeout_s}")
        if self.max_retries < 0:
            fail("scoring.teacher.max_retries", f"must be >= 0, got {self.max_retries}")
        if not 0.0 <= self.max_error_rate <= 1.0:
            fail("scoring.teacher.max_error_rate", f"must be in [0, 1], got {self.max_error_rate}")
        if self.engine.url_dir is not None:
            fail("scoring.teacher.engine.url_dir", "teacher engines are started by the run or given by "
                 "scoring.teacher.engine.urls; set url_dir to null")
        if self.engine.urls and not self.enabled:
            fail("scoring.teacher.hf_path", "must name the teacher's checkpoint when scoring.teacher.engine.urls is "
                 "set (its tokenizer is checked against the student's)")


@dataclass(kw_only=True)
class ScoringConfig:
    """How groups are scored (``mrl.rollout.scorers.build_scorer``): ``reward_weight * reward.fn`` (or the multi-turn
    environment's reward) + each of ``scorers`` by its weight + the teacher's per-token reverse KL."""

    reward_weight: float = 1.0
    """Weight of ``reward.fn``'s reward (the environment's, for multi-turn episodes); 0 = not run (on-policy
    distillation alone)."""
    gate_threshold: float = 1.0
    """``gated`` scorers count only where ``reward.fn``'s reward is at least this."""
    scorers: list[ScorerSpec] = field(default_factory=list)
    """Group scorers of the user's, e.g. ``scoring.scorers=[{cls: my_pkg.Judge, weight: 0.5}]``."""
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """On-policy distillation from teacher engines."""

    @property
    def default(self) -> bool:
        """``reward.fn`` alone, weight 1: the rewards of a run without scorers."""
        return self.reward_weight == 1.0 and not self.scorers and not self.teacher.enabled

    def __post_init__(self) -> None:
        if self.reward_weight < 0.0:
            fail("scoring.reward_weight", f"must be >= 0, got {self.reward_weight}")
        if self.reward_weight == 0.0 and not self.scorers and not self.teacher.enabled:
            fail("scoring.reward_weight", "is 0 and no other scorer is configured: nothing would score the samples "
                 "(set scoring.teacher.hf_path or scoring.scorers)")
        for i, s in enumerate(self.scorers):
            if s.cls.count(".") < 1 or not all(s.cls.split(".")):
                fail(f"scoring.scorers[{i}].cls", f"expected a dotted path 'package.module.Class', got {s.cls!r}")
