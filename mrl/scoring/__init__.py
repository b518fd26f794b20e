"""Group-level scoring: the ``Scorer`` interface, the rule and environment scorers, their composition, and the
teacher engine pool of on-policy distillation (``mrl.scoring.teacher``). See docs/scoring.md."""

from mrl.scoring.base import GroupScores, NoScoringEngine, Scorer, ScoringError, ScoringGroup, load_scorer
from mrl.scoring.compose import Gate, WeightedSum
from mrl.scoring.rule import EnvScorer, RuleScorer

__all__ = ["EnvScorer", "Gate", "GroupScores", "NoScoringEngine", "RuleScorer", "Scorer", "ScoringError",
           "ScoringGroup", "WeightedSum", "load_scorer"]
