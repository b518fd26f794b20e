"""The RL loop (steps, batches, staleness, warm start, checkpoints) and the experiment trackers."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

from mrl.config.base import DType, fail
from mrl.config.eval import HELDOUT, EvalSetConfig, check_eval_sets


class LoopMode(str, enum.Enum):
    overlap = "overlap"  # engines generate continuously; the trainer consumes from the buffer
    sync = "sync"  # generate -> train -> sync, no overlap (the baseline)


class BadRoutes(str, enum.Enum):
    error = "error"  # stop the run, naming the sample
    drop = "drop"  # drop the sample's group (counted) and take another


class BadSupport(str, enum.Enum):
    error = "error"  # stop the run, naming the sample
    mask = "mask"  # take the token out of the loss (counted)


class GroupedGemm(str, enum.Enum):
    cutlass = "cutlass"  # one CUTLASS grouped kernel for all local experts (Hopper, bf16/fp16)
    cublas = "cublas"  # one cuBLAS GEMM per expert on a pool of streams (Transformer Engine's default)


class Recompute(str, enum.Enum):
    off = "off"  # every layer's activations kept for backward
    full = "full"  # megatron's full recompute, one layer at a time: only each layer's input is kept
    selective = "selective"  # megatron's selective recompute: the core attention is recomputed


class StalePolicy(str, enum.Enum):
    drop = "drop"  # samples older than max_staleness are dropped (counted)
    keep = "keep"  # kept; the off-policy correction (algo.correction) weighs them


@dataclass(kw_only=True)
class TrainConfig:
    """The RL loop (mrl/trainer/loop.py): steps, batch shape, staleness, warm start, logging, checkpoints."""

    mode: LoopMode = LoopMode.overlap
    steps: int = 60
    """RL optimizer steps."""
    prompts_per_step: int = 16
    """GRPO groups per step (each of rollout.n_samples_per_prompt samples)."""
    micro_batch_size: int = 16
    """Samples per micro-batch per DP rank."""
    max_staleness: int = 1
    """Oldest token of a trained sample may be this many weight versions behind the trainer."""
    stale_policy: StalePolicy = StalePolicy.drop
    max_inflight_groups: int = 32
    """Groups generating at once (async mode); also bounds the buffer."""
    batch_timeout_s: float = 600.0
    """How long the controller waits for a step's groups before failing with the producer's counts."""
    sft_warmup_steps: int = 0
    """Supervised warm start on the task's reference answers, through the same Megatron trainer."""
    sft_lr: float = 1e-3
    sft_batch: int = 32
    clip_grad: float = 1.0
    weight_decay: float = 0.0
    optimizer_states_dtype: DType = DType.fp32
    """Adam moments (and master-weight storage). bf16: megatron's precision-aware optimizer, 6 bytes per
    bf16 parameter of the optimizer's shard instead of 12 (docs/memory.md); needs Transformer Engine on GPUs."""
    lr_warmup_steps: int = 0
    eval_every: int = 10
    """Evaluate ``eval_sets`` every N steps, and once before the first RL step (0 = never). Evaluations
    generate on the rollout engines while training goes on; their results are reported as they arrive,
    at the step and weight version they measured (docs/evaluation.md)."""
    eval_sets: list[EvalSetConfig] = field(default_factory=lambda: [EvalSetConfig()])
    """Held-out sets and what to measure on each (greedy pass@1, sampled pass@k); by default greedy pass@1
    on 32 prompts of the run's held-out split."""
    eval_max_inflight: int = 8
    """Evaluation requests in flight at once, over all engines: evaluations interleave with rollouts and
    take at most this share of the engines' batch."""
    eval_wait_at_end_s: float = 600.0
    """At the run's last step, how long to wait for evaluations still generating (their results are
    reported; then the run ends); 0 = not at all."""
    routing_metrics_every: int = 1
    """A natural-routing (record) forward every N steps: disagreement and replay-on/off KL."""
    save_every: int = 0
    """Checkpoint (megatron dist_checkpointing + loop state) every N steps; 0 = only on SIGUSR1/end."""
    save_at_end: bool = True
    """Checkpoint at the last step. false: a run that will not be resumed skips it (a benchmark of a model
    whose weights and optimizer states outsize the disk); a stop (SIGUSR1, ``stop_after``) still saves."""
    keep_checkpoints: int = 0
    """Keep the newest N complete checkpoints: older ones are deleted once a newer one is complete (its
    files synced to disk before its marker is written); 0 = keep every one."""
    async_save: bool = False
    """Write checkpoints while training goes on (megatron's asynchronous dist_checkpointing): a save stages
    each rank's shards to host memory (as much host memory as the rank's shards) and a forked process writes
    them; the checkpoint counts as complete, and older ones are pruned, once every rank's writer is done. A
    run waits for a save still writing before the next one and at its end (docs/training.md)."""
    optimizer_checkpoint: str = "dp_reshardable"
    """How checkpoints hold the optimizer state (megatron's DistributedOptimizer sharding types).
    dp_reshardable: every rank writes its own shard, nothing gathered; resumes in the same TP/PP/EP/ETP/CP
    layout (DP may change). fully_reshardable: resumes in any layout, but each save gathers every
    model-parallel group's fp32 state into host memory on its DP rank 0, several copies of it while
    saving (docs/training.md). A resume reads each checkpoint in its own format."""
    save_hf: bool = True
    """At the run's last step, the model as a Hugging Face checkpoint in ``run_dir/hf/final`` (sharded
    safetensors + index, config and tokenizer; LoRA runs: the PEFT adapter directory), written from the
    live model as ``mrl export`` writes one from a checkpoint (docs/training.md, "Getting the model out")."""
    save_hf_every: int = 0
    """Also every N steps, as ``run_dir/hf/step_N`` (0 = never); each is a full copy of the weights."""
    resume: bool = True
    """Resume from the newest checkpoint in run_dir/checkpoints if there is one."""
    stop_after: Optional[int] = None
    """Stop (after checkpointing) once this step is done: for tests of resume."""
    replay: bool = True
    """Keep Routing: replay the engine's experts in training."""
    fused_router_replay: bool = False
    """Replay through Transformer Engine's fused router kernels (the engine's experts masked in, TE's
    fused top-k and score kernels) instead of megatron's unfused replay path; same values. GPU with
    TE only (refused elsewhere); no auxiliary losses or token dropping. Off until measured on GPUs."""
    fused_logprob: bool = True
    """Token logprobs with Transformer Engine's fused cross-entropy kernel on GPUs with TE (one pass over
    the bf16 logits, the gradient written into their buffer) instead of mrl's fp32 path, which keeps an
    fp32 copy of the logits for backward; same values up to fp32 rounding. Vocabulary shards with
    padding columns (TP where the padded vocabulary differs) and CPU runs take the fp32 path."""
    recompute: Recompute = Recompute.off
    """Activation recompute in backward: ``full`` keeps each layer's input and recomputes the layer (what
    makes a deep model's micro-batches fit beside frozen base weights; Keep Routing replays the same experts
    in the recompute), ``selective`` the core attention only (megatron's recipe for long sequences)."""
    bad_routes: BadRoutes = BadRoutes.error
    """A sample whose routes are missing or mis-sized: never trained with wrong routing."""
    packing: bool = True
    """Sequence packing: several samples per row (first-fit decreasing) so long-tailed batches waste no
    padding; ``micro_batch_size`` then counts packed rows. Megatron's local attention gets a
    block-diagonal causal mask (verified equal to unpacked), the Transformer Engine spec THD
    ``cu_seqlens`` (TE's fused attention; run on GPUs)."""
    pack_max_len: Optional[int] = None
    """Packed row length in tokens; null = the step's longest sample (rounded up to a multiple of tp)."""
    warmup_pass: Optional[bool] = None
    """Before the first RL step, one forward and backward of a full-size micro-batch of random tokens, thrown
    away (``mrl.megatron.warm_up``): the first step's one-time kernel and allocator costs are paid while the
    engines boot. No trace in training. null = on with CUDA (a GPU's first step costs seconds more than the
    next ones), off on CPU."""
    compile_cache_dir: Optional[str] = "${engine.compile_cache_dir}"
    """GPU trainer ranks: where torch inductor and triton keep what they compile (megatron's torch.compile'd
    helpers compile again for new shapes during the first RL steps), so the next job's ranks find it
    (``mrl.compile_cache``); the engines' directory by default. null: their defaults under /tmp. The
    caller's ``TORCHINDUCTOR_CACHE_DIR`` / ``TRITON_CACHE_DIR`` win."""
    sampling_mask: bool = False
    """Keep Sampling Mask: train on the support the engine sampled from (rollout top_k / top_p / min_p):
    logprobs renormalized over it, rebuilt from the engine's top logprobs (``rollout.top_logprobs_num``)."""
    bad_support: BadSupport = BadSupport.error
    """Sampling mask: a token whose support cannot be rebuilt, or that lies outside it (an engine bug):
    stop the run, or take it out of the loss (counted)."""
    grouped_gemm: GroupedGemm = GroupedGemm.cutlass
    """Transformer Engine's kernel for the experts' grouped GEMM on Hopper GPUs (TE's
    ``NVTE_USE_CUTLASS_GROUPED_GEMM``, set by the trainer): ``cutlass`` launches one kernel for all local
    experts where ``cublas`` launches one per expert, which leaves a 128-expert layer waiting on the
    host. Other GPUs, other dtypes and the local spec ignore it."""
    max_nonfinite_steps: int = 5
    """Optimizer steps skipped in a row for a non-finite (NaN/Inf) loss or gradient before the run stops
    (every skip is counted: metric ``nonfinite_steps``); 0 = never stop."""
    gc_freeze: bool = True
    """After the trainer's setup, collect once and freeze what is alive out of Python's later garbage
    collections (``gc.freeze``): a full collection then scans what the steps allocated, not the whole
    heap of torch, megatron and transformers objects, which pauses a rank for a large fraction of a
    second while its peers wait at the next collective."""
    gc_interval: int = 0
    """> 0: Python's automatic collection is off in the trainer processes and a full collection runs
    every this many optimizer steps, after the step, on every rank at once (megatron-LM's manual GC), so
    no rank pauses mid-step on its own; 0 = Python's automatic collection."""

    @property
    def eval_heldout(self) -> bool:
        """Some evaluation set reads the run's held-out split."""
        return any(s.source == HELDOUT for s in self.eval_sets)

    @property
    def eval_files(self) -> list[EvalSetConfig]:
        """The evaluation sets read from a JSONL file."""
        return [s for s in self.eval_sets if s.source != HELDOUT]

    def __post_init__(self) -> None:
        for name in ("steps", "prompts_per_step", "micro_batch_size", "max_inflight_groups", "sft_batch"):
            if getattr(self, name) < 1:
                fail(f"train.{name}", f"must be >= 1, got {getattr(self, name)}")
        if self.max_staleness < 0:
            fail("train.max_staleness", f"must be >= 0, got {self.max_staleness}")
        if self.gc_interval < 0:
            fail("train.gc_interval", f"must be >= 0 (0 = Python's automatic collection), got {self.gc_interval}")
        if self.max_nonfinite_steps < 0:
            fail("train.max_nonfinite_steps", f"must be >= 0, got {self.max_nonfinite_steps}")
        if self.optimizer_checkpoint not in OPTIMIZER_CHECKPOINT_FORMATS:
            fail("train.optimizer_checkpoint", f"must be one of {', '.join(OPTIMIZER_CHECKPOINT_FORMATS)}, got "
                 f"{self.optimizer_checkpoint!r}")
        if self.save_hf_every < 0:
            fail("train.save_hf_every", f"must be >= 0 (0 = never), got {self.save_hf_every}")
        if self.keep_checkpoints < 0:
            fail("train.keep_checkpoints", f"must be >= 0 (0 keeps every checkpoint), got {self.keep_checkpoints}")
        if self.eval_max_inflight < 1:
            fail("train.eval_max_inflight", f"must be >= 1, got {self.eval_max_inflight}")
        if self.eval_wait_at_end_s < 0:
            fail("train.eval_wait_at_end_s", f"must be >= 0, got {self.eval_wait_at_end_s}")
        if self.eval_every < 0:
            fail("train.eval_every", f"must be >= 0 (0 = never), got {self.eval_every}")
        if self.eval_every and not self.eval_sets:
            fail("train.eval_sets", "is empty while train.eval_every > 0: name a set, or set train.eval_every=0")
        check_eval_sets(self.eval_sets)
        if self.pack_max_len is not None and self.pack_max_len < 2:
            fail("train.pack_max_len", f"must be >= 2 or null, got {self.pack_max_len}")


OPTIMIZER_CHECKPOINT_FORMATS = ("dp_reshardable", "fully_reshardable")
"""``train.optimizer_checkpoint``'s values (``mrl.megatron.checkpoint_format``)."""

LOGGERS = ("tensorboard", "wandb", "mlflow")
"""Experiment trackers ``logger`` may list (``mrl.loggers``)."""


@dataclass(kw_only=True)
class TrackingConfig:
    """Where the trackers of ``logger`` file the run (W&B project and run, MLflow experiment and run)."""

    project: str = "mrl"
    """W&B project; MLflow experiment."""
    run_name: Optional[str] = None
    """Run name in W&B and MLflow; null = the run directory's name."""
    offline: bool = False
    """W&B offline mode (its files under ``run_dir/wandb``, uploaded later with ``wandb sync``); MLflow to a
    local file store (``run_dir/mlruns``) unless ``mlflow_tracking_uri`` is set."""
    mlflow_tracking_uri: Optional[str] = None
    """MLflow tracking URI (``http://host:5000``, ``file:/path``); null = MLflow's own
    (``$MLFLOW_TRACKING_URI``), or the local file store with ``offline``."""

    def __post_init__(self) -> None:
        if not self.project:
            fail("tracking.project", "must be a non-empty name")
        if self.run_name == "":
            fail("tracking.run_name", "must be a non-empty name or null")
