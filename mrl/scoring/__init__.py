"""Group-level scoring: the ``Scorer`` interface, composition, and the engine pools of model scorers (the teacher
of on-policy distillation: ``mrl.scoring.teacher``). The run's scorer is built by the rollout side
(``mrl.rollout.scorers``), which holds ``reward.fn`` and the environments. See docs/scoring.md."""

from mrl.scoring.base import GroupScores, NoScoringEngine, Scorer, ScoringError, ScoringGroup, load_scorer
from mrl.scoring.compose import Gate, WeightedSum

__all__ = ["Gate", "GroupScores", "NoScoringEngine", "Scorer", "ScoringError", "ScoringGroup", "WeightedSum",
           "load_scorer"]
