"""Dataclass schema of the mrl configuration: the root ``Config`` and the rollout node here, the other nodes in
the module of their component (``mrl.config.model``, ``engine``, ``algo``, ``data``, ``weight_sync``,
``cluster``, ``train``), all importable from here.

This module must import without torch, megatron-core or SGLang: launchers, login nodes and the
config tests use it alone. Enumerated fields are Enums (OmegaConf 2.3 rejects ``Literal``), so an
invalid override fails at composition time with the field's full key and the allowed values.
Cross-field checks live in ``__post_init__``, which runs at ``OmegaConf.to_object``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from mrl.config.base import DType
from mrl.config.base import fail as _fail
from mrl.config.model import (Dispatcher, TinyPreset, LoraConfig, ModelConfig, ParallelConfig, LORA_TARGETS,
                              LORA_HF_MODULES)
from mrl.config.algo import (AdvEstimator, LossType, Aggregation, Correction, CorrectionLevel, KLEstimator, AlgoConfig,
                             OldLogprobs)
from mrl.config.data import HF_TASK, BadRowPolicy, DataConfig, DataFormat, RewardConfig, RewardExecutor, RewardOnError
from mrl.config.weight_sync import PauseMode, WeightTransport, WeightSyncConfig
from mrl.config.cluster import ClusterKind, ContainerKind, ClusterConfig
from mrl.config.train import (LoopMode, BadRoutes, BadSupport, GroupedGemm, Recompute, StalePolicy, TrainConfig,
                              TrackingConfig, LOGGERS)
from mrl.config.lora_engine import lora_engine_spec
from mrl.config.engine import EngineConfig
from mrl.config.scoring import ScorerSpec, ScoringConfig, TeacherConfig, check_reference

__all__ = [
    "AdvEstimator",
    "Aggregation",
    "AlgoConfig",
    "BadRoutes",
    "BadRowPolicy",
    "BadSupport",
    "ClusterConfig",
    "ClusterKind",
    "Config",
    "ContainerKind",
    "Correction",
    "CorrectionLevel",
    "DType",
    "DataConfig",
    "DataFormat",
    "Dispatcher",
    "EngineConfig",
    "EnvConfig",
    "GroupedGemm",
    "HF_TASK",
    "KLEstimator",
    "LOGGERS",
    "LORA_HF_MODULES",
    "LORA_TARGETS",
    "LoopMode",
    "LoraConfig",
    "LossType",
    "OldLogprobs",
    "Recompute",
    "ModelConfig",
    "PauseMode",
    "ParallelConfig",
    "RewardConfig",
    "RewardExecutor",
    "RewardOnError",
    "RolloutConfig",
    "ScorerSpec",
    "ScoringConfig",
    "StalePolicy",
    "TeacherConfig",
    "TinyPreset",
    "TrackingConfig",
    "TrainConfig",
    "WeightSyncConfig",
    "WeightTransport",
]


@dataclass(kw_only=True)
class EnvConfig:
    """Multi-turn, tool-using episodes (``mrl.rollout.multiturn``): an environment answers each model turn."""

    fn: Optional[str] = None
    """Dotted path of an ``mrl.env.Environment`` class (or factory), one instance per episode; null = the
    built-in task's own (``data=lookup``: ``mrl.env.lookup.LookupEnv``), else single-turn rollouts."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of ``fn`` (``+rollout.env.args.x=1``)."""
    max_turns: int = 4
    """Model turns per episode; the episode ends after the last one."""
    max_total_tokens: int = 256
    """The whole conversation (prompt, turns, observations); an observation that would reach it ends the
    episode."""
    max_turn_tokens: Optional[int] = None
    """New tokens per model turn; null = what a built-in multi-turn task's turns need (``data=lookup``: the
    tool call), else ``rollout.max_new_tokens``."""
    tool_timeout_s: float = 10.0
    """Limit of one ``step`` (the tools it calls): a slower step is cancelled and its error is the next
    observation (counted)."""

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            _fail("rollout.env.max_turns", f"must be >= 1, got {self.max_turns}")
        if self.max_total_tokens < 2:
            _fail("rollout.env.max_total_tokens", f"must be >= 2, got {self.max_total_tokens}")
        if self.max_turn_tokens is not None and self.max_turn_tokens < 1:
            _fail("rollout.env.max_turn_tokens", f"must be >= 1 or null, got {self.max_turn_tokens}")
        if not self.tool_timeout_s > 0:
            _fail("rollout.env.tool_timeout_s", f"must be > 0, got {self.tool_timeout_s}")
        if self.fn is not None and (self.fn.count(".") < 1 or not all(self.fn.split("."))):
            _fail("rollout.env.fn", f"expected a dotted path 'package.module.Class', got {self.fn!r}")


@dataclass(kw_only=True)
class RolloutConfig:
    """What the rollout client asks of the engines: sampling, and the multi-turn environment. The engines
    themselves are the ``engine:`` node (``mrl.config.engine.EngineConfig``)."""

    n_samples_per_prompt: int = 4
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    top_logprobs_num: Optional[int] = None
    """Top logprobs per response token asked of the engine for Keep Sampling Mask (``train.sampling_mask``);
    null = top_k. Must reach the support's edge: with top_k = -1 set it (the support is rebuilt only where
    its top_p / min_p cut falls inside the returned candidates)."""
    ignore_eos: bool = False
    """Generate every sample to its full budget (benchmarks with controlled lengths)."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Multi-turn episodes: the environment and its limits."""

    def __post_init__(self) -> None:
        if not 0.0 < self.top_p <= 1.0:
            _fail("rollout.top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            _fail("rollout.min_p", f"must be in [0, 1], got {self.min_p}")
        if self.top_logprobs_num is not None and self.top_logprobs_num < 1:
            _fail("rollout.top_logprobs_num", f"must be >= 1 or null, got {self.top_logprobs_num}")


_ENGINE_DTYPES = {DType.fp32: "float32", DType.bf16: "bfloat16"}


@dataclass(kw_only=True)
class Config:
    """Root config: one node per component; YAML presets in conf/ extend it."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run_dir: str = "runs/default"
    """Where logs, the resolved config and outputs go."""
    seed: int = 1234
    logger: list[str] = field(default_factory=lambda: ["tensorboard"])
    """Experiment trackers that get the config, every metric per step and the curves, from rank 0: any of
    tensorboard, wandb, mlflow (``logger=[tensorboard,wandb]``; wandb and mlflow: ``pip install
    'mrl[tracking]'``). ``metrics.jsonl`` and ``curves.png`` are written whatever the list."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """Project and run names of the trackers, offline mode."""

    def _check_pause_mode(self) -> None:
        """``weight_sync.pause_mode`` retract / in_place: refused where it cannot hold its promises."""
        mode = self.weight_sync.pause_mode.value
        if self.model.lora.enabled:
            _fail("weight_sync.pause_mode", f"={mode} with model.lora: a LoRA run never pauses the engines (each "
                  "adapter version is served beside the older ones, requests finish on the version they began "
                  "with); leave pause_mode=abort")
        if self.engine.dp > 1:
            _fail("weight_sync.pause_mode", f"={mode} with engine.dp={self.engine.dp}: an in-flight update tags "
                  "each token in the scheduler that ran it, and SGLang's data-parallel controller in front of "
                  "several schedulers was never tested with it; use abort, or more engines of dp=1")
        if mode == "staged":
            self._check_staged()
        if mode in ("in_place", "staged") and not self.engine.cpu_mode:
            # the GPU bench flagged one token per request around an in-place swap (docs/weight_sync.md): until a GPU
            # run shows its tags exact, the staleness bound and the off-policy correction could see wrong versions
            _fail("weight_sync.pause_mode", f"={mode} with GPU engines: the versions of tokens decoded around an "
                  "in-place swap on GPU engines (SGLang's overlap scheduler) are not yet confirmed exact "
                  "(bench/reports/weight_sync/*_weight_sync_inflight_*, docs/weight_sync.md#pause-modes), so "
                  "training could see wrong versions; use retract (requests keep running, their KV recomputed) "
                  "or abort")

    def _check_staged(self) -> None:
        """``weight_sync.pause_mode=staged``: the transports and engines a staged update serves."""
        t = self.weight_sync.transport
        if t == WeightTransport.distributed:
            _fail("weight_sync.pause_mode", "=staged with weight_sync.transport=distributed: the engine would "
                  "receive the broadcasts on a thread beside its own forward passes (on GPUs, NCCL collectives of "
                  "two communicators at once), which no run has checked yet; use weight_sync=tensor (engines "
                  "beside the trainer) or weight_sync=disk, or pause_mode=retract")
        if self.engine.quantization is not None:
            _fail("weight_sync.pause_mode", f"=staged with engine.quantization={self.engine.quantization}: a "
                  "quantized engine processes its weights after each load (new tensors, scales), which the staged "
                  "copy of the parameters does not follow; use pause_mode=retract or abort")

    @property
    def samples_per_step(self) -> int:
        """Samples in a step's batch: train.prompts_per_step groups of rollout.n_samples_per_prompt."""
        return self.train.prompts_per_step * self.rollout.n_samples_per_prompt

    def __post_init__(self) -> None:
        for name in self.logger:
            if name not in LOGGERS:
                _fail("logger", f"unknown logger {name!r}; choose from {list(LOGGERS)}")
        if len(set(self.logger)) != len(self.logger):
            _fail("logger", f"lists a logger twice: {list(self.logger)}")
        e = self.engine
        sc = self.scoring
        pools = [("engine", e), *((f"{c.NODE}.engine", c.engine) for c in sc.pools.values())]
        for c in sc.pools.values():
            if c.nodes and self.cluster.kind != ClusterKind.slurm:
                _fail(f"{c.NODE}.nodes", f"={c.nodes} places the pool's engines on Slurm nodes of their own "
                      "(mrl launch, cluster.kind=slurm); a local run starts them on this machine: set nodes=0")
        for key, pool in pools:
            if pool.cpu_mode and pool.dtype not in (None, "float32"):
                _fail(f"{key}.dtype", f"{pool.dtype!r}: SGLang's CPU mode runs float32 only (bf16 gives NaN)")
            if pool.dtype is None:
                pool.dtype = "float32" if pool.cpu_mode else _ENGINE_DTYPES[self.model.dtype]
            if not pool.cpu_mode and pool.dtype == "float32":
                _fail(f"{key}.dtype", "float32 on GPU engines: SGLang's GPU kernels (rmsnorm) take bfloat16 or "
                      f"float16 only; set model.dtype=bf16 (the engine follows it) or {key}.dtype=bfloat16")
        if self.train.sampling_mask and not e.cpu_mode:
            if e.sampling_backend == "flashinfer":
                _fail("engine.sampling_backend", "=flashinfer with train.sampling_mask=true: the mask rebuilds the "
                      "support of SGLang's pytorch sampler; use pytorch (or null)")
            e.sampling_backend = "pytorch"
        shared = (not e.cpu_mode and self.cluster.kind == ClusterKind.local and not e.urls
                  and e.url_dir is None and e.base_gpu_id is not None
                  and e.base_gpu_id < self.parallel.world_size)
        if shared and self.weight_sync.transport == WeightTransport.distributed:
            _fail("engine.base_gpu_id", f"={e.base_gpu_id} puts an engine on a trainer rank's GPU (ranks use GPUs "
                  f"0..{self.parallel.world_size - 1}), and NCCL cannot join two ranks of one GPU in the "
                  "weight_sync.transport=distributed group; give the engines GPUs of their own (null: the ones "
                  "after the trainer's) or set weight_sync.transport=tensor (CUDA IPC) or disk")
        if e.quantization == "fp8" and self.model.lora.enabled:
            _fail("engine.quantization", "=fp8 with model.lora: SGLang's LoRA layers over a block-FP8 base are not "
                  "what the trainer computes (bf16 base + adapter) and were never tested here; use null")
        if self.weight_sync.pause_mode != PauseMode.abort:
            self._check_pause_mode()
        if self.model.lora.enabled:  # what the engines could not serve, refused now rather than at launch
            lora_engine_spec(self)
        if self.parallel.cp > 1 and self.model.dtype != DType.bf16:
            _fail("parallel.cp", f"={self.parallel.cp} with model.dtype={self.model.dtype.value}: Transformer "
                  "Engine's context-parallel attention runs in its flash/fused kernels, bf16 only; set "
                  "model.dtype=bf16 or parallel.cp=1")
        check_reference(self)
        if self.weight_sync.pause_mode.value != "abort" and self.engine.urls:
            # only engines with mrl's patches (the job's, or `mrl engine`'s) tag each token with its weights' version
            _fail("weight_sync.pause_mode", f"={self.weight_sync.pause_mode.value} with engine.urls: engines attached "
                  "by URL may lack mrl's engine patches that tag each token with the version of the weights that "
                  "produced it, so the versions of requests running across a sync could not be known; let the job "
                  "start the engines, start them with `mrl engine` (engine.url_dir), or use pause_mode=abort")
        if self.parallel.collective_timeout_s <= self.train.batch_timeout_s:
            _fail("parallel.collective_timeout_s", f"={self.parallel.collective_timeout_s} must exceed "
                  f"train.batch_timeout_s={self.train.batch_timeout_s}: trainer ranks other than 0 wait in the "
                  "batch broadcast while rank 0 waits for rollouts")
