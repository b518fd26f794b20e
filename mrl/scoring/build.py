"""The run's group scorer from its config (``scoring:``, ``reward:``)."""

from __future__ import annotations

import os

from mrl.config.schema import Config
from mrl.reward.scorer import RewardScorer
from mrl.scoring.base import Scorer, load_scorer
from mrl.scoring.compose import Gate, WeightedSum
from mrl.scoring.rule import EnvScorer, RuleScorer


def build_scorer(cfg: Config, rewards: RewardScorer, *, episodes: bool, student_path: str) -> Scorer:
    """``reward_weight * (reward.fn, or the environment's reward for episodes)`` + each user scorer by its
    weight (gated ones behind ``reward.fn``'s check) + the teacher's per-token reverse KL. The default config
    gives the ``reward.fn`` scorer alone. Teacher engines the run starts begin booting here."""
    sc = cfg.scoring
    base: Scorer = EnvScorer() if episodes else RuleScorer(rewards)
    if sc.default:
        return base
    parts: list[tuple[Scorer, float]] = [(base, sc.reward_weight)] if sc.reward_weight > 0 else []
    for spec in sc.scorers:
        scorer = load_scorer(spec.cls, dict(spec.args))
        if spec.gated:
            scorer = Gate(RuleScorer(rewards), scorer, sc.gate_threshold)
        parts.append((scorer, spec.weight))
    if sc.teacher.enabled:
        from mrl.scoring.pool import ScoringPool
        from mrl.scoring.teacher import TeacherScorer
        from mrl.scoring.tokenizer import tokenizer_mismatch

        if why := tokenizer_mismatch(student_path, sc.teacher.hf_path):
            raise ValueError(f"scoring.teacher.hf_path={sc.teacher.hf_path}: the teacher must share the student's "
                             f"tokenizer ({student_path}): {why}")
        pool = ScoringPool(sc.teacher, sc.teacher.hf_path, log_dir=os.path.join(cfg.run_dir, "engines"))
        parts.append((TeacherScorer(sc.teacher, pool.start()), 1.0))  # coef is applied per token by the scorer
    return WeightedSum(parts)
