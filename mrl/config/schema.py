"""Dataclass schema of the mrl configuration: the root ``Config`` and the rollout node here, the other nodes in
the module of their component (``mrl.config.model``, ``algo``, ``data``, ``weight_sync``, ``cluster``,
``train``), all importable from here.

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
from mrl.config.algo import AdvEstimator, LossType, Aggregation, Correction, CorrectionLevel, KLEstimator, AlgoConfig
from mrl.config.data import BadRowPolicy, DataConfig, RewardExecutor, RewardOnError, RewardConfig
from mrl.config.weight_sync import WeightTransport, WeightSyncConfig
from mrl.config.cluster import ClusterKind, ContainerKind, ClusterConfig
from mrl.config.train import (LoopMode, BadRoutes, BadSupport, GroupedGemm, StalePolicy, TrainConfig, TrackingConfig,
                              LOGGERS)
from mrl.config.lora_engine import lora_engine_spec

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
    "Dispatcher",
    "EnvConfig",
    "GroupedGemm",
    "KLEstimator",
    "LOGGERS",
    "LORA_HF_MODULES",
    "LORA_TARGETS",
    "LoopMode",
    "LoraConfig",
    "LossType",
    "ModelConfig",
    "ParallelConfig",
    "RewardConfig",
    "RewardExecutor",
    "RewardOnError",
    "RolloutConfig",
    "StalePolicy",
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


ROLLOUT_QUANTIZATIONS = (None, "fp8")
"""``rollout.quantization``: null (the engine dtype) or block-wise FP8 (mrl.quant.fp8)."""
KV_CACHE_DTYPES = (None, "fp8_e4m3", "fp8_e5m2", "bfloat16")
"""``rollout.kv_cache_dtype``: SGLang's ``--kv-cache-dtype`` choices mrl passes (null = SGLang's auto)."""


@dataclass(kw_only=True)
class RolloutConfig:
    """SGLang engine pool and sampling."""

    num_engines: int = 1
    """SGLang servers (one per DP replica)."""
    engine_tp: int = 1
    engine_ep: int = 1
    engine_dp: int = 1
    """DP inside one server: only with server_args.enable_dp_attention."""
    cpu_mode: bool = True
    """Run engines on CPU (fp32, torch_native attention, CUDA driver stub)."""
    cpu_batched_attention: bool = True
    """CPU mode: SGLang's torch_native attention takes the whole batch in one SDPA call
    (``mrl.engine.server.cpu_attention``) instead of looping over sequences in Python, which made a CPU
    engine's cost grow linearly with its batch. false = SGLang's own loop."""
    memory_saver: bool = False
    """GPU only: --enable-memory-saver (colocated runs release/resume engine memory)."""
    base_gpu_id: Optional[int] = None
    """GPU: first GPU of the first engine on a node; engine i takes the ``engine_tp * engine_dp`` GPUs that
    follow ``base_gpu_id + i * engine_tp * engine_dp``. null = the GPUs after the trainer ranks' on this node
    (``mrl train`` on one node of N GPUs: trainer on the first ones, engines on the rest)."""
    mem_fraction_static: Optional[float] = None
    """GPU: share of each engine GPU's memory for weights and KV cache (null: SGLang's own choice)."""
    attention_backend: Optional[str] = None
    """GPU: SGLang attention backend (triton | fa3 | flashinfer); null = triton. ``fa3`` starts the engines
    without SGLang's prefill CUDA graphs, whose capture faults with FA3 in SGLang 0.5.14 (docs/gpu.md), unless
    ``server_args`` decides them."""
    sampling_backend: Optional[str] = None
    """GPU: SGLang sampling backend (pytorch | flashinfer); null = pytorch with ``train.sampling_mask``
    (the support it rebuilds is the pytorch sampler's), else SGLang's default."""
    engine_dtype: Optional[str] = None
    """Engine weights dtype, also the dtype weights are synced in (bfloat16, float16, float32); null =
    the trainer's ``model.dtype``. CPU mode runs float32 only."""
    max_total_tokens: Optional[int] = None
    """KV-cache tokens per engine; null = 4096 in CPU mode, sized from ``mem_fraction_static`` on GPU."""
    quantization: Optional[str] = None
    """GPU engines' weights: null = ``engine_dtype``; ``fp8`` = block-wise FP8 (e4m3, one scale per 128x128
    block, SGLang's ``fp8`` method): attention, MLP and expert projections in FP8, norms, router,
    embeddings and head in ``engine_dtype``. The engines start from ``<run_dir>/fp8_model``, the block-FP8
    export of ``model.hf_path`` made once per run, and the trainer (bf16) quantizes at every weight sync
    (``mrl.quant``, docs/fp8.md). Not in CPU mode (SGLang's CPU FP8 kernels need AMX and a bf16 engine),
    not with LoRA."""
    compile_cache_dir: Optional[str] = "~/.cache/mrl/compile"
    """GPU engines: where torch inductor and triton keep what they compile at start (prefill CUDA graphs,
    kernels), so the next run's engines start warm; put it on storage the nodes share and keep. null:
    their defaults (inductor's under /tmp). The caller's ``TORCHINDUCTOR_CACHE_DIR`` / ``TRITON_CACHE_DIR``
    win."""
    fp8_ignore: list[str] = field(default_factory=list)
    """``quantization=fp8``: modules kept in ``engine_dtype`` on top of the rule (norms, router, embeddings and
    head always are), as dotted paths matched on whole components like SGLang's ``modules_to_not_convert``,
    e.g. ``[model.layers.0, model.layers.47]`` (first and last layers) or ``[self_attn]`` (every attention
    projection). The run's export and every weight sync follow it. SGLang fuses q/k/v, gate/up and a layer's
    experts: each such group is kept whole or not at all (the export refuses a split one)."""
    moe_kernel_configs: Optional[str] = None
    """GPU engines: a folder of tile-size tables for SGLang's triton fused-MoE kernel tuned on this GPU
    and triton (``mrl tune-moe``, ``mrl.engine.moe_tuning``); null: SGLang's own tables, which may be
    another triton version's. SGLang's tables stay in use for every shape the folder does not cover."""
    kv_cache_dtype: Optional[str] = None
    """Engines' KV cache (SGLang ``--kv-cache-dtype``): null = the engine's dtype; ``fp8_e4m3``, ``fp8_e5m2``
    (both without calibrated scales: SGLang uses 1.0), ``bfloat16``. Independent of ``quantization``; CPU
    engines take the FP8 ones too (torch_native attention stores the cache in FP8 and reads it back), so the
    mismatch it adds can be measured on CPU."""
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
    max_running_requests: int = 8
    """Requests one engine decodes at once (SGLang ``--max-running-requests``); the rollout manager keeps
    at most this many on each engine, the rest queue on the trainer side (abortable, re-routable)."""
    cpus: Optional[list[int]] = None
    """CPU mode: cores the engines are pinned to (null = all). The trainer ranks then keep to the other
    cores, so generation and training overlap without fighting over the same cores (``train.mode=overlap``
    on a small box)."""
    cpu_threads: Optional[int] = None
    """CPU mode: torch/OpenMP threads of each engine TP rank; null = the rank's share of ``cpus`` (all cores
    when unset)."""
    restart_engines: int = 3
    """Replacements the job may start, in all, for engines it started that die (0 = none); a replacement
    joins at the first weight sync after it is healthy. Engines attached by URL are never restarted."""
    client_process: bool = True
    """Run the rollout client (producer, HTTP to the engines, routes decoding, rewards, buffer) in a process
    of its own beside trainer rank 0 (``mrl.rollout.service``), not in a thread of rank 0, where it shares
    the training step's GIL."""
    server_args: dict[str, Any] = field(default_factory=dict)
    """Extra ``sglang.launch_server`` flags, passed through (``+rollout.server_args.x=1``)."""
    engine_urls: list[str] = field(default_factory=list)
    """Attach to already-running engines (http://host:port) instead of starting them."""
    engine_url_dir: Optional[str] = None
    """Attach to engines that announce themselves as ``<dir>/<name>.url`` files (written by
    ``mrl engine`` on cluster engine nodes); waits for ``num_engines`` of them."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Multi-turn episodes: the environment and its limits."""
    lora_max_rank: Optional[int] = None
    """LoRA (model.lora): the engines' ``--max-lora-rank``, the largest adapter rank they accept (their
    adapter pool is sized for it at launch); null = model.lora.rank."""
    lora_slots: int = 4
    """LoRA: ``--max-loras-per-batch``, adapter versions one engine batch may mix, the base model counting
    as one. A request whose version finds no free slot waits for one. Each slot is preallocated for the
    max rank over every target of every layer (expert targets: keep it small)."""
    lora_backend: Optional[str] = None
    """LoRA: SGLang ``--lora-backend`` (torch_native, triton, csgmv); null = torch_native in CPU mode,
    SGLang's default (csgmv) on GPU."""

    def __post_init__(self) -> None:
        if self.lora_max_rank is not None and self.lora_max_rank < 1:
            _fail("rollout.lora_max_rank", f"must be >= 1 or null, got {self.lora_max_rank}")
        if self.lora_slots < 2:
            _fail("rollout.lora_slots", f"must be >= 2 (the base model takes one), got {self.lora_slots}")
        if self.lora_backend not in (None, "torch_native", "triton", "csgmv"):
            _fail("rollout.lora_backend", f"must be torch_native, triton, csgmv or null, got {self.lora_backend!r}")
        if self.cpu_mode and self.lora_backend not in (None, "torch_native"):
            _fail("rollout.lora_backend", f"={self.lora_backend}: CPU engines have no GPU kernels; use torch_native")
        if not 0.0 < self.top_p <= 1.0:
            _fail("rollout.top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            _fail("rollout.min_p", f"must be in [0, 1], got {self.min_p}")
        if self.top_logprobs_num is not None and self.top_logprobs_num < 1:
            _fail("rollout.top_logprobs_num", f"must be >= 1 or null, got {self.top_logprobs_num}")
        if self.num_engines < 1:
            _fail("rollout.num_engines", f"must be >= 1, got {self.num_engines}")
        if self.restart_engines < 0:
            _fail("rollout.restart_engines", f"must be >= 0, got {self.restart_engines}")
        if self.max_running_requests < 1:
            _fail("rollout.max_running_requests", f"must be >= 1, got {self.max_running_requests}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            _fail("rollout.cpu_threads", f"must be >= 1 or null, got {self.cpu_threads}")
        if self.cpus is not None and (not self.cpus or min(self.cpus) < 0):
            _fail("rollout.cpus", f"={list(self.cpus)}: give a non-empty list of core ids, or null")
        if self.base_gpu_id is not None and self.base_gpu_id < 0:
            _fail("rollout.base_gpu_id", f"must be >= 0 or null, got {self.base_gpu_id}")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            _fail("rollout.mem_fraction_static", f"must be in (0, 1) or null, got {self.mem_fraction_static}")
        if self.sampling_backend not in (None, "pytorch", "flashinfer"):
            _fail("rollout.sampling_backend", f"must be pytorch, flashinfer or null, got {self.sampling_backend!r}")
        if self.engine_dtype not in (None, "bfloat16", "float16", "float32"):
            _fail("rollout.engine_dtype", f"must be bfloat16, float16, float32 or null, got {self.engine_dtype!r}")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            _fail("rollout.max_total_tokens", f"must be >= 1 or null, got {self.max_total_tokens}")
        if self.quantization not in ROLLOUT_QUANTIZATIONS:
            _fail("rollout.quantization", f"must be one of {list(ROLLOUT_QUANTIZATIONS)}, got {self.quantization!r}")
        for key, field_ in (("quantization", "rollout.quantization"), ("kv_cache_dtype", "rollout.kv_cache_dtype")):
            if key in self.server_args:  # the fields also choose the checkpoint and what the weight sync sends
                _fail(f"rollout.server_args.{key}", f"set {field_} instead (the engines' checkpoint and the weight "
                      "sync follow it; a server flag alone would not)")
        if self.quantization is not None and self.cpu_mode:
            _fail("rollout.quantization", f"={self.quantization}: CPU engines cannot serve block-FP8 weights (SGLang "
                  "0.5.14's CPU FP8 layers need AMX and the sgl-kernel CPU build, and mrl's CPU engines run float32, "
                  "which SGLang's fp8 method refuses); use GPU engines (rollout=gpu) or null")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            _fail("rollout.kv_cache_dtype", f"must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.fp8_ignore and self.quantization != "fp8":
            _fail("rollout.fp8_ignore", f"={list(self.fp8_ignore)} keeps modules out of FP8, but "
                  f"rollout.quantization={self.quantization}: set quantization=fp8 or leave the list empty")
        bad = [m for m in self.fp8_ignore if not isinstance(m, str) or not m.strip(". ") or any(c.isspace() for c in m)]
        if bad:
            _fail("rollout.fp8_ignore", f"entries must be dotted module paths (e.g. model.layers.0.self_attn), "
                  f"got {bad}")
        if self.moe_kernel_configs is not None:
            if self.cpu_mode:
                _fail("rollout.moe_kernel_configs", "tunes SGLang's triton fused-MoE kernel of GPU engines; CPU "
                      "engines do not run it: set it to null")


_ENGINE_DTYPES = {DType.fp32: "float32", DType.bf16: "bfloat16"}


@dataclass(kw_only=True)
class Config:
    """Root config: one node per component; YAML presets in conf/ extend it."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
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

    def __post_init__(self) -> None:
        for name in self.logger:
            if name not in LOGGERS:
                _fail("logger", f"unknown logger {name!r}; choose from {list(LOGGERS)}")
        if len(set(self.logger)) != len(self.logger):
            _fail("logger", f"lists a logger twice: {list(self.logger)}")
        r = self.rollout
        if r.cpu_mode and r.engine_dtype not in (None, "float32"):
            _fail("rollout.engine_dtype", f"{r.engine_dtype!r}: SGLang's CPU mode runs float32 only (bf16 gives NaN)")
        if r.engine_dtype is None:
            r.engine_dtype = "float32" if r.cpu_mode else _ENGINE_DTYPES[self.model.dtype]
        if not r.cpu_mode and r.engine_dtype == "float32":
            _fail("rollout.engine_dtype", "float32 on GPU engines: SGLang's GPU kernels (rmsnorm) take bfloat16 or "
                  "float16 only; set model.dtype=bf16 (the engine follows it) or rollout.engine_dtype=bfloat16")
        if self.train.sampling_mask and not self.rollout.cpu_mode:
            if self.rollout.sampling_backend == "flashinfer":
                _fail("rollout.sampling_backend", "=flashinfer with train.sampling_mask=true: the mask rebuilds the "
                      "support of SGLang's pytorch sampler; use pytorch (or null)")
            self.rollout.sampling_backend = "pytorch"
        shared = (not r.cpu_mode and self.cluster.kind == ClusterKind.local and not r.engine_urls
                  and r.engine_url_dir is None and r.base_gpu_id is not None
                  and r.base_gpu_id < self.parallel.world_size)
        if shared and self.weight_sync.transport == WeightTransport.distributed:
            _fail("rollout.base_gpu_id", f"={r.base_gpu_id} puts an engine on a trainer rank's GPU (ranks use GPUs "
                  f"0..{self.parallel.world_size - 1}), and NCCL cannot join two ranks of one GPU in the "
                  "weight_sync.transport=distributed group; give the engines GPUs of their own (null: the ones "
                  "after the trainer's) or set weight_sync.transport=tensor (CUDA IPC) or disk")
        if r.quantization == "fp8" and self.model.lora.enabled:
            _fail("rollout.quantization", "=fp8 with model.lora: SGLang's LoRA layers over a block-FP8 base are not "
                  "what the trainer computes (bf16 base + adapter) and were never tested here; use null")
        if self.model.lora.enabled:  # what the engines could not serve, refused now rather than at launch
            lora_engine_spec(self)
        if self.parallel.collective_timeout_s <= self.train.batch_timeout_s:
            _fail("parallel.collective_timeout_s", f"={self.parallel.collective_timeout_s} must exceed "
                  f"train.batch_timeout_s={self.train.batch_timeout_s}: trainer ranks other than 0 wait in the "
                  "batch broadcast while rank 0 waits for rollouts")
