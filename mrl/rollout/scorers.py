"""The run's group scorer (``scoring:``, ``reward:``), and the two scorers made of what the rollout side already
holds: ``reward.fn`` on each response (``RuleScorer``) and a multi-turn environment's reward (``EnvScorer``).

    scorer = build_scorer(cfg, RewardScorer(cfg.reward), episodes=False, student_path=hf_path,
                          side_engines={"teacher": group})   # groups from mrl.trainer.engines.RunEngines
"""

from __future__ import annotations

from mrl.config.schema import Config
from mrl.config.scoring import EnginePoolConfig, ModelScorerConfig
from mrl.reward.scorer import RewardScorer
from mrl.scoring.base import GroupScores, Scorer, ScoringGroup, load_scorer
from mrl.scoring.compose import Gate, WeightedSum


class RuleScorer(Scorer):
    """``reward.fn(prompt, response_text)`` per sample, through ``RewardScorer``: its workers, timeouts,
    ``on_error`` and error-rate limit as they are (a dropped reward drops the group)."""

    name = "reward"

    def __init__(self, rewards: RewardScorer):
        self.rewards = rewards

    async def score(self, group: ScoringGroup) -> GroupScores:
        results = await self.rewards.score_many([(group.prompt, t) for t in group.texts])
        return GroupScores(rewards=[r.value for r in results], errors=[r.error for r in results])

    def stats(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.rewards.stats.items()}


class EnvScorer(Scorer):
    """A multi-turn episode's reward: the sum of its environment's step rewards (``Sample.reward``)."""

    name = "env"

    async def score(self, group: ScoringGroup) -> GroupScores:
        return GroupScores(rewards=[float(s.reward) for s in group.samples])


def build_scorer(cfg: Config, rewards: RewardScorer, *, episodes: bool, student_path: str,
                 side_engines: dict | None = None) -> Scorer:
    """``reward_weight * (reward.fn, or the environment's reward for episodes)`` + each user scorer by its
    weight (gated ones behind ``reward.fn``'s check) + the teacher's per-token reverse KL + the PRM's step rewards
    + the judge's and the reward model's rewards by their weights; the reference pool (``scoring.reference``) adds
    no reward and fills ``Sample.ref_logprobs``. The default config gives the ``reward.fn`` scorer alone.
    ``side_engines``: the unstarted server groups of the pools the run
    starts, by pool name; they begin booting here."""
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
    pools = {name: _side_pool(p, student_path, side_engines) for name, p in sc.pools.items()}
    if "teacher" in pools:
        from mrl.scoring.teacher import TeacherScorer

        parts.append((TeacherScorer(sc.teacher, pools["teacher"]), 1.0))  # coef is applied per token by the scorer
    if "prm" in pools:
        from mrl.scoring.process_reward import ProcessRewardScorer

        parts.append((ProcessRewardScorer(sc.prm, pools["prm"]), 1.0))  # weight is applied per step by the scorer
    if "reference" in pools:
        from mrl.scoring.reference import ReferenceScorer

        parts.append((ReferenceScorer(sc.reference, pools["reference"]), 0.0))  # no reward: fills ref_logprobs
    for name, mcfg in sc.model_scorers.items():
        scorer = _model_scorer(name, mcfg, pools[name])
        if mcfg.gated:
            scorer = Gate(RuleScorer(rewards), scorer, sc.gate_threshold)
        parts.append((scorer, mcfg.weight))
    return WeightedSum(parts)


def _side_pool(cfg: EnginePoolConfig, student_path: str, side_engines: dict | None):
    """The started pool of ``scoring.<name>``: its servers are the run's (``side_engines[name]``) or
    ``engine.urls``. The checkpoint of a pool that reads the policy's tokens (teacher, PRM, reference) must share
    the policy's tokenizer; a judge or reward model renders its own input."""
    from mrl.scoring.pool import ScoringPool
    from mrl.scoring.tokenizer import tokenizer_mismatch

    path = cfg.model_path(student_path)
    if not isinstance(cfg, ModelScorerConfig) and (why := tokenizer_mismatch(student_path, path)):
        raise ValueError(f"{cfg.NODE}.hf_path={path}: it must share the policy's tokenizer ({student_path}): {why}")
    group = (side_engines or {}).get(cfg.name)
    if group is None and not cfg.engine.urls:
        raise ValueError(f"{cfg.NODE}: no engines to score on (the run starts them: "
                         "mrl.trainer.engines.RunEngines.side_groups)")
    return ScoringPool(cfg, group, name=cfg.name).start()


def _model_scorer(name: str, mcfg: ModelScorerConfig, pool) -> Scorer:
    """The judge or reward model scorer on its started pool."""
    from mrl.scoring.judge import JudgeScorer
    from mrl.scoring.reward_model import RewardModelScorer

    return JudgeScorer(mcfg, pool) if name == "judge" else RewardModelScorer(mcfg, pool)
