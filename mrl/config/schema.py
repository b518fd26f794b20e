"""Dataclass schema of the mrl configuration, one node per component.

This module must import without torch, megatron-core or SGLang: launchers, login nodes and the
config tests use it alone. Enumerated fields are Enums (OmegaConf 2.3 rejects ``Literal``), so an
invalid override fails at composition time with the field's full key and the allowed values.
Cross-field checks live in ``__post_init__``, which runs at ``OmegaConf.to_object``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional


class DType(str, enum.Enum):
    fp32 = "fp32"
    bf16 = "bf16"


class Dispatcher(str, enum.Enum):
    """megatron-core MoE token dispatcher."""

    alltoall = "alltoall"
    allgather = "allgather"


class TinyPreset(str, enum.Enum):
    """Built-in random Qwen3-MoE checkpoints (``mrl make-tiny-model``)."""

    tiny = "tiny"          # 3 MoE layers, 8 experts top-2, hidden 64, vocab 512: the default model
    stress_a = "stress_a"  # head_dim*heads != hidden, rope 1e6, one dense layer, vocab 500 (padded)
    stress_b = "stress_b"  # MoE every 2nd layer, norm_topk_prob off, tied embeddings, 16 experts top-4


def _fail(key: str, msg: str) -> None:
    raise ValueError(f"{key}: {msg}")


@dataclass(kw_only=True)
class ModelConfig:
    """Which Hugging Face checkpoint the trainer and engines load."""

    hf_path: str = "runs/models/tiny"
    """Directory of a Hugging Face checkpoint (config.json + *.safetensors [+ tokenizer.json])."""
    make_tiny_if_missing: bool = True
    """Write the built-in tiny checkpoint at ``hf_path`` when the directory does not exist."""
    tiny_preset: TinyPreset = TinyPreset.tiny
    """Preset used by ``make_tiny_if_missing``."""
    dtype: DType = DType.fp32
    """Parameter and compute dtype of the trainer (CPU runs must use fp32)."""
    vocab_divisible_by: int = 128
    """Megatron pads the vocabulary to a multiple of vocab_divisible_by * tp (pad rows are zero and
    never reach logprobs)."""
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.vocab_divisible_by < 1:
            _fail("model.vocab_divisible_by", f"must be >= 1, got {self.vocab_divisible_by}")


@dataclass(kw_only=True)
class ParallelConfig:
    """Trainer layout, with megatron-core's meaning of each degree.

    DP is implied: world_size / (tp * pp * cp). Experts use EP x ETP inside the same ranks.
    """

    tp: int = 1
    """Tensor parallel size."""
    pp: int = 1
    """Pipeline parallel size."""
    ep: int = 1
    """Expert parallel size (must divide the number of experts)."""
    etp: Optional[int] = None
    """Expert tensor parallel size; null means megatron's default (= tp)."""
    cp: int = 1
    """Context parallel size."""
    sequence_parallel: bool = True
    """Sequence parallelism; required for MoE with tp > 1 (megatron-core refuses to train without it)."""
    dispatcher: Dispatcher = Dispatcher.alltoall
    """MoE token dispatcher."""
    world_size: Optional[int] = None
    """Expected number of trainer processes; null means whatever torchrun provides."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep", "cp"):
            if getattr(self, name) < 1:
                _fail(f"parallel.{name}", f"must be >= 1, got {getattr(self, name)}")
        if self.etp is not None and self.etp < 1:
            _fail("parallel.etp", f"must be >= 1 or null, got {self.etp}")
        if self.tp > 1 and not self.sequence_parallel:
            _fail(
                "parallel.sequence_parallel",
                f"must be true when parallel.tp={self.tp} > 1: megatron-core MoE layers cannot train "
                "with tensor parallelism and no sequence parallelism (expert grads come out tp times too large)",
            )
        if self.world_size is not None:
            self.check_world_size(self.world_size)

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    def check_world_size(self, world_size: int) -> None:
        """Raise a ValueError naming the fields when the layout does not fit ``world_size`` ranks."""
        mp = self.model_parallel_size
        if world_size % mp:
            _fail(
                "parallel.tp/pp/cp",
                f"world size {world_size} is not divisible by tp*pp*cp = {self.tp}*{self.pp}*{self.cp} = {mp}",
            )
        expert_mp = self.ep * self.expert_tp * self.pp
        if world_size % expert_mp:
            _fail(
                "parallel.ep/etp/pp",
                f"world size {world_size} is not divisible by ep*etp*pp = "
                f"{self.ep}*{self.expert_tp}*{self.pp} = {expert_mp}",
            )
        if self.world_size is not None and self.world_size != world_size:
            _fail("parallel.world_size", f"is {self.world_size} but {world_size} processes were started")

    def check_model(self, *, num_experts: int, num_layers: int, num_query_groups: int) -> None:
        """Raise a ValueError naming the fields when the layout cannot shard this model."""
        if num_experts and num_experts % self.ep:
            _fail("parallel.ep", f"={self.ep} does not divide the model's {num_experts} experts")
        if num_layers % self.pp:
            _fail("parallel.pp", f"={self.pp} does not divide the model's {num_layers} layers")
        if self.tp > num_query_groups and self.tp % num_query_groups:
            _fail("parallel.tp", f"={self.tp} is neither a divisor nor a multiple of {num_query_groups} KV heads")
        if self.tp <= num_query_groups and num_query_groups % self.tp:
            _fail("parallel.tp", f"={self.tp} does not divide the model's {num_query_groups} KV heads")


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
    memory_saver: bool = False
    """GPU only: --enable-memory-saver (colocated runs release/resume engine memory)."""
    """Run engines on CPU (fp32, torch_native attention, CUDA driver stub)."""
    n_samples_per_prompt: int = 4
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    server_args: dict[str, Any] = field(default_factory=dict)
    """Extra ``sglang.launch_server`` flags, passed through (``+rollout.server_args.x=1``)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.top_p <= 1.0:
            _fail("rollout.top_p", f"must be in (0, 1], got {self.top_p}")
        if self.num_engines < 1:
            _fail("rollout.num_engines", f"must be >= 1, got {self.num_engines}")


class AdvEstimator(str, enum.Enum):
    grpo = "grpo"
    rloo = "rloo"


class LossType(str, enum.Enum):
    grpo = "grpo"
    dapo = "dapo"
    gspo = "gspo"


@dataclass(kw_only=True)
class AlgoConfig:
    """RL algorithm: advantage estimator, policy loss, corrections."""

    adv_estimator: AdvEstimator = AdvEstimator.grpo
    loss: LossType = LossType.grpo
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    lr: float = 1e-5


@dataclass(kw_only=True)
class DataConfig:
    """Prompt source: a built-in synthetic task or a JSONL file."""

    task: str = "reverse"
    path: Optional[str] = None


@dataclass(kw_only=True)
class RewardConfig:
    """Reward function by dotted path."""

    fn: str = "mrl.reward.builtin.exact_match"


class WeightTransport(str, enum.Enum):
    distributed = "distributed"
    disk = "disk"


@dataclass(kw_only=True)
class WeightSyncConfig:
    """Trainer -> engine weight sync."""

    transport: WeightTransport = WeightTransport.distributed
    bucket_mb: int = 512
    every_n_steps: int = 1


class ClusterKind(str, enum.Enum):
    local = "local"
    slurm = "slurm"


@dataclass(kw_only=True)
class ClusterConfig:
    """Where processes run."""

    kind: ClusterKind = ClusterKind.local
    nproc_per_node: int = 1
    """Trainer processes started locally (torchrun --nproc_per_node)."""
    partition: Optional[str] = None
    account: Optional[str] = None
    gpus_per_node: int = 8
    num_train_nodes: int = 1
    num_rollout_nodes: int = 1
    image: Optional[str] = None


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
    run_dir: str = "runs/default"
    """Where logs, the resolved config and outputs go."""
    seed: int = 1234
