"""The ``scoring:`` node: which scorers turn a group of samples into rewards (``mrl.scoring``), and the engine pools
of model scorers (the teacher of on-policy distillation, a generative judge, a reward model). The default is
``reward.fn`` alone, as a run without this node."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

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
class EnginePoolConfig:
    """The keys every engine-served scorer pool has (``mrl.scoring.pool.ScoringPool``): the checkpoint, the
    servers, the limits of a call, the nodes of its own. ``NODE`` is the pool's config path (in errors);
    ``SERVER_ARGS`` are SGLang flags its servers always get."""

    NODE: ClassVar[str] = "scoring.pool"
    SERVER_ARGS: ClassVar[dict[str, Any]] = {}

    hf_path: Optional[str] = None
    """The pool's Hugging Face checkpoint (null: the pool is off). With ``engine.urls`` it names the running
    servers' checkpoint."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The servers: the same keys as the rollout pool's ``engine:`` (count, tp, cpus, server_args, urls,
    max_restarts, ...); LoRA keys do not apply, and ``url_dir`` is the Slurm job's (``nodes``)."""
    timeout_s: float = 120.0
    """Limit of one call; an engine that passes it and fails its liveness probe is replaced."""
    max_retries: int = 3
    """A group's call moves to another engine at most this many times before the group is dropped."""
    max_error_rate: float = 0.5
    """The run stops once more than this share of the last 64 groups could not be scored."""
    health_timeout_s: float = 600.0
    """How long an engine (or its replacement) may take to become healthy."""
    nodes: int = 0
    """``mrl launch`` only: Slurm nodes of the pool's own, after the rollout engine nodes, each running
    ``engine.count / nodes`` of its servers (``mrl engine --pool <name>``); the run attaches to them as they
    announce themselves. 0: the rollout process starts the servers on the trainer's node."""

    @property
    def name(self) -> str:
        """The pool's name: its key under ``scoring:``."""
        return self.NODE.rpartition(".")[2]

    @property
    def enabled(self) -> bool:
        return self.hf_path is not None

    def model_path(self, policy_path: str) -> Optional[str]:
        """The checkpoint the servers load (``policy_path``: the run's ``model.hf_path``)."""
        return self.hf_path

    def __post_init__(self) -> None:
        n = self.NODE
        if not self.timeout_s > 0:
            fail(f"{n}.timeout_s", f"must be > 0, got {self.timeout_s}")
        if self.max_retries < 0:
            fail(f"{n}.max_retries", f"must be >= 0, got {self.max_retries}")
        if not 0.0 <= self.max_error_rate <= 1.0:
            fail(f"{n}.max_error_rate", f"must be in [0, 1], got {self.max_error_rate}")
        if self.engine.url_dir is not None and not self.nodes:
            fail(f"{n}.engine.url_dir", f"the pool's engines are started by the run or given by {n}.engine.urls; "
                 f"url_dir is set by the Slurm job for a pool on nodes of its own ({n}.nodes > 0)")
        if self.engine.urls and self.hf_path is None:
            fail(f"{n}.hf_path", f"must name the served checkpoint when its engines are attached ({n}.engine.urls): "
                 "its tokenizer is checked against the policy's or renders the model's input")
        if self.nodes < 0:
            fail(f"{n}.nodes", f"must be >= 0, got {self.nodes}")
        if self.nodes:
            if not self.enabled:
                fail(f"{n}.nodes", f"={self.nodes} but {n} is off: nodes are for an engine-served scorer the run "
                     f"uses (give it a checkpoint, {n}.hf_path, or set nodes=0)")
            if self.engine.urls:
                fail(f"{n}.nodes", f"={self.nodes} with {n}.engine.urls: those servers run elsewhere already; set "
                     "nodes=0 or drop the URLs")
            if self.nodes > self.engine.count:
                fail(f"{n}.nodes", f"={self.nodes} is more nodes than {n}.engine.count={self.engine.count} engines "
                     "can use (every node of the pool runs at least one)")
            if self.engine.count % self.nodes:
                fail(f"{n}.nodes", f"={self.nodes} does not divide {n}.engine.count={self.engine.count} (every node "
                     "of the pool runs the same number of engines)")


@dataclass(kw_only=True)
class TeacherConfig(EnginePoolConfig):
    """On-policy distillation: teacher engines score the student's sampled tokens by prefill (no generation);
    each token's reward is ``coef * (teacher logprob - student logprob)``, the per-token reverse KL's negative."""

    NODE: ClassVar[str] = "scoring.teacher"
    hf_path: Optional[str] = None
    """The teacher's Hugging Face checkpoint (null: no teacher). It must share the student's tokenizer (the
    preflight compares them). With ``engine.urls`` it names the running teachers' checkpoint."""
    coef: float = 1.0
    """Weight of the per-token reverse KL in the advantage (slime's ``--opd-kl-coef``)."""
    clip: Optional[float] = None
    """Bound on each token's ``|teacher logprob - student logprob|`` before ``coef`` (null: none). Where the
    student samples a token the teacher all but rules out, the log ratio runs to -10 or below while most tokens
    sit near 0; a few such tokens then set the direction of a whole step, and a bound keeps every sampled token's
    say in the update."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.coef <= 0.0:
            fail("scoring.teacher.coef", f"must be > 0, got {self.coef}")
        if self.clip is not None and not self.clip > 0.0:
            fail("scoring.teacher.clip", f"must be > 0 or null, got {self.clip}")


@dataclass(kw_only=True)
class PRMConfig(EnginePoolConfig):
    """A process reward model: a generative PRM on engines reads, after each step of a response, the probability
    of its "good" verdict token against its "bad" one (``mrl.scoring.process_reward``); the step's reward
    ``weight * (p_good - baseline)`` goes on the step's last token."""

    NODE: ClassVar[str] = "scoring.prm"
    hf_path: Optional[str] = None
    """The PRM's Hugging Face checkpoint (null: no PRM); it must share the policy's tokenizer."""
    weight: float = 1.0
    """Scale of the step rewards (token rewards: they reach the advantage unnormalized)."""
    separator: str = "\n\n"
    """A step ends where this text ends in a model turn; every model turn ends a step too. "" = turns only."""
    step_tag: str = ""
    """Text inserted after each step in what the PRM reads (e.g. Math-Shepherd's " ки"); "" = none."""
    good_token: str = "+"
    """The PRM's verdict token for a good step (one token of the shared tokenizer)."""
    bad_token: str = "-"
    """The PRM's verdict token for a bad step (one token)."""
    baseline: float = 0.5
    """Subtracted from each step's p_good: a step the PRM cannot judge adds nothing, and a response of many
    middling steps does not gather reward by its length alone."""

    @property
    def enabled(self) -> bool:
        return self.hf_path is not None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.weight > 0:
            fail("scoring.prm.weight", f"must be > 0, got {self.weight}")
        if not self.good_token or not self.bad_token or self.good_token == self.bad_token:
            fail("scoring.prm.good_token", f"good_token={self.good_token!r} and bad_token={self.bad_token!r} must be "
                 "two different non-empty tokens")


@dataclass(kw_only=True)
class ReferenceConfig(EnginePoolConfig):
    """The KL reference on engines: a frozen reference pool prefills each finished sample and its logprobs are
    the ``ref_logp`` of ``algo.kl_coef``'s term, instead of the trainer swapping reference weights in for a
    forward each step (``mrl.megatron.reference``)."""

    NODE: ClassVar[str] = "scoring.reference"
    enabled: bool = False
    """Take the KL reference's logprobs from this pool (needs ``algo.kl_coef > 0``)."""
    hf_path: Optional[str] = None
    """The reference checkpoint; null = ``model.hf_path``, the weights RL starts from (as the trainer's own
    reference, unless a warm start or a LoRA ``init_from`` changed them first: then name it)."""

    def model_path(self, policy_path: str) -> Optional[str]:
        return self.hf_path or policy_path


@dataclass(kw_only=True)
class ModelScorerConfig(EnginePoolConfig):
    """A model scorer whose reward is weighted into the sum (a judge, a reward model): its pool, its weight."""

    NODE: ClassVar[str] = "scoring.model"
    weight: float = 1.0
    """Its weight in the sum of the scorers' rewards."""
    gated: bool = False
    """Count it only for samples whose ``reward.fn`` reward reaches ``scoring.gate_threshold`` (0 elsewhere)."""


JUDGE_TEMPLATE = ("Question: {prompt}\nReference answer: {answer}\nResponse: {response}\n"
                  "Is the response correct? Answer YES or NO.\nVerdict:")


@dataclass(kw_only=True)
class JudgeConfig(ModelScorerConfig):
    """A generative judge (``mrl.scoring.judge``): each sample is put into ``template``, the judge engine writes a
    verdict, ``verdict_regex`` finds it and it becomes the sample's reward."""

    NODE: ClassVar[str] = "scoring.judge"

    template: str = JUDGE_TEMPLATE
    """The judge's prompt: ``{prompt}`` (the prompt's text), ``{response}`` (the sample's text) and ``{answer}``
    (the prompt's reference answer, "" when it has none); ``{{`` and ``}}`` for literal braces. Rendered as one
    user message with the judge tokenizer's chat template when it has one (``chat_template``)."""
    chat_template: bool = True
    """Apply the judge tokenizer's chat template (with the generation prompt) when it has one."""
    verdict_regex: str = r"(?i)\b(yes|no)\b"
    """Where the verdict is in the judge's text: its first capture group, at the first match."""
    verdicts: Optional[dict[str, float]] = field(default_factory=lambda: {"yes": 1.0, "no": 0.0})
    """Captured verdict (lowercased) -> reward. null: the capture is a number, scaled from ``score_range`` to
    [0, 1] (e.g. ``verdict_regex='Score: (\\d+)' verdicts=null score_range=[0,10]``)."""
    score_range: list[float] = field(default_factory=lambda: [0.0, 10.0])
    """``[low, high]`` of a numeric verdict (``verdicts`` null); a number outside it does not parse."""
    max_new_tokens: int = 32
    """Tokens the judge may write."""
    temperature: float = 0.0
    """Sampling temperature of the first attempt."""
    top_p: float = 1.0
    retry_temperature: float = 1.0
    """Temperature of the attempts after a verdict did not parse (a greedy verdict would come out the same)."""
    parse_retries: int = 2
    """New attempts for a sample whose verdict did not parse (counted), before ``fallback`` applies."""
    fallback: Optional[float] = None
    """Reward of a sample whose verdict never parsed (counted as a reward error); null: its group is dropped,
    never trained on a made-up score."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_new_tokens < 1:
            fail("scoring.judge.max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        if self.parse_retries < 0:
            fail("scoring.judge.parse_retries", f"must be >= 0, got {self.parse_retries}")
        if self.temperature < 0 or self.retry_temperature < 0:
            fail("scoring.judge.temperature", "temperature and retry_temperature must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            fail("scoring.judge.top_p", f"must be in (0, 1], got {self.top_p}")
        if self.verdicts is not None and not self.verdicts:
            fail("scoring.judge.verdicts", "is empty: map verdicts to rewards, or set it to null for numeric verdicts")
        if len(self.score_range) != 2 or not self.score_range[0] < self.score_range[1]:
            fail("scoring.judge.score_range", f"must be [low, high] with low < high, got {list(self.score_range)}")


@dataclass(kw_only=True)
class RewardModelConfig(ModelScorerConfig):
    """A reward model (``mrl.scoring.reward_model``): a ``*ForSequenceClassification`` / ``*ForRewardModel``
    checkpoint served by SGLang's classification path (``/classify``); its score of prompt + response is the
    sample's reward."""

    NODE: ClassVar[str] = "scoring.reward_model"
    SERVER_ARGS: ClassVar[dict[str, Any]] = {"is_embedding": True}  # SGLang's classification path

    chat_template: bool = True
    """Render prompt and response as a user and an assistant message with the reward model tokenizer's chat
    template when it has one; otherwise (or false) the model scores ``prompt + response`` as plain text."""
    scale: float = 1.0
    """The reward is ``scale * (score - shift)``."""
    shift: float = 0.0


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
    prm: PRMConfig = field(default_factory=PRMConfig)
    """Step rewards of a process reward model on engines (token rewards)."""
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    """The KL reference's logprobs from engines instead of the trainer's weight swap."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """A generative judge on engines of its own."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """A reward model on engines of its own."""

    @property
    def default(self) -> bool:
        """``reward.fn`` alone, weight 1: the rewards of a run without scorers."""
        return self.reward_weight == 1.0 and not self.scorers and not self.pools

    @property
    def pools(self) -> dict[str, EnginePoolConfig]:
        """The enabled engine-served scorer pools, by name (their key here)."""
        every = (self.teacher, self.prm, self.reference, self.judge, self.reward_model)
        return {p.name: p for p in every if p.enabled}

    @property
    def model_scorers(self) -> dict[str, ModelScorerConfig]:
        """The enabled model scorers whose reward is weighted into the sum (judge, reward model), by pool name."""
        return {k: c for k, c in self.pools.items() if isinstance(c, ModelScorerConfig)}

    def __post_init__(self) -> None:
        if self.reward_weight < 0.0:
            fail("scoring.reward_weight", f"must be >= 0, got {self.reward_weight}")
        if (self.reward_weight == 0.0 and not self.scorers and not self.teacher.enabled and not self.prm.enabled
                and not self.model_scorers):
            fail("scoring.reward_weight", "is 0 and no other scorer is configured: nothing would score the samples "
                 "(set scoring.teacher.hf_path, scoring.prm.hf_path, scoring.judge.hf_path, "
                 "scoring.reward_model.hf_path or scoring.scorers)")
        for i, s in enumerate(self.scorers):
            if s.cls.count(".") < 1 or not all(s.cls.split(".")):
                fail(f"scoring.scorers[{i}].cls", f"expected a dotted path 'package.module.Class', got {s.cls!r}")


def check_reference(cfg: Any) -> None:
    """``scoring.reference`` against the other nodes (``Config.__post_init__``): what the engines' logprobs
    could not stand in for is refused."""
    ref = cfg.scoring.reference
    if not ref.enabled:
        return
    if cfg.algo.kl_coef <= 0:
        fail("scoring.reference.enabled", "is true but algo.kl_coef is 0: nothing reads the reference; set "
             "algo.kl_coef > 0 or scoring.reference.enabled=false")
    if cfg.rollout.temperature not in (0.0, 1.0):
        fail("scoring.reference.enabled", f"with rollout.temperature={cfg.rollout.temperature}: the trainer's KL "
             "compares logprobs of softmax(logits / T) and an engine's prefill logprobs are at T=1; use the "
             "trainer's reference (scoring.reference.enabled=false)")
    if cfg.train.sampling_mask:
        fail("scoring.reference.enabled", "with train.sampling_mask=true: the trainer's reference logprobs are "
             "renormalized over each token's sampling support, which an engine's prefill does not know; use the "
             "trainer's reference")
    if ref.hf_path is None and (cfg.train.sft_warmup_steps or cfg.model.lora.init_from):
        fail("scoring.reference.hf_path", "is null (model.hf_path) but RL does not start from model.hf_path "
             "(train.sft_warmup_steps or model.lora.init_from changes the weights first): name the reference "
             "checkpoint")
