"""The model (HF checkpoint, dtype, LoRA) and the trainer's parallel layout."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

from mrl.config.base import DType, fail


class Dispatcher(str, enum.Enum):
    """megatron-core MoE token dispatcher."""

    alltoall = "alltoall"
    allgather = "allgather"


class TinyPreset(str, enum.Enum):
    """Built-in random checkpoints (``mrl make-tiny-model``): Qwen3-MoE unless named after a family."""

    tiny = "tiny"          # 3 MoE layers, 8 experts top-2, hidden 64, vocab 512: the default model
    stress_a = "stress_a"  # head_dim*heads != hidden, rope 1e6, one dense layer, vocab 500 (padded)
    stress_b = "stress_b"  # MoE every 2nd layer, norm_topk_prob off, tied embeddings, 16 experts top-4
    glm4_moe = "glm4_moe"  # GLM-4.5: first layer dense, shared expert, sigmoid + bias, partial rotary, qkv bias
    deepseek_v3 = "deepseek_v3"  # DeepSeek-V3: MLA, YaRN, group-limited sigmoid routing, shared expert, first dense
    tiny_gpu = "tiny_gpu"  # tiny with head_dim 64, hidden 256: SGLang's GPU kernels refuse head_dim 16
    small_gpu = "small_gpu"  # 8 MoE layers, 32 experts top-4, hidden 512 (~0.1B): the GPU recipes' model
    tiny_lora = "tiny_lora"  # tiny with its output head x10 (std 0.2): a base LoRA can adapt (mrl/models/tiny.py)


LORA_TARGETS = ("attention", "dense_mlp", "experts")
LORA_HF_MODULES = {"attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
                   "dense_mlp": ("gate_proj", "up_proj", "down_proj"),
                   "experts": ("gate_proj", "up_proj", "down_proj")}
"""Hugging Face leaf module names (PEFT ``target_modules``, SGLang ``--lora-target-modules``) of each target."""


@dataclass(kw_only=True)
class LoraConfig:
    """LoRA: train low-rank adapters on frozen base weights (``mrl.megatron.lora``); the engines get only the
    adapters (HF PEFT format). The update of a wrapped linear is ``(alpha / rank) * B @ A``.

    Plain LoRA only: no dropout (it would make the trainer's logprobs stochastic against the engine's), and
    no rsLoRA, DoRA or per-module ranks (SGLang reads ``r``, ``lora_alpha`` and ``target_modules`` and
    ignores the rest, so the engine would sample from another policy). The MoE router is never a target."""

    rank: int = 0
    """Adapter rank r; 0 = LoRA off (full fine-tuning)."""
    alpha: float = 32.0
    """Scaling numerator: the update is scaled by alpha / rank (PEFT's ``lora_alpha``)."""
    targets: list[str] = field(default_factory=lambda: ["attention"])
    """Which linears get adapters: ``attention`` (q/k/v/o projections), ``dense_mlp`` (gate/up/down of the
    dense MLP layers), ``experts`` (gate/up/down of every routed expert). Shared experts, the router,
    embeddings and norms stay frozen."""
    init_from: Optional[str] = None
    """Start from this HF PEFT directory (adapter_config.json + adapter_model.safetensors; rank and alpha
    must match) instead of a fresh adapter (B = 0, so the first policy is the base model)."""

    def __post_init__(self) -> None:
        if self.rank < 0:
            fail("model.lora.rank", f"must be >= 0 (0 = off), got {self.rank}")
        if not (self.alpha > 0 and self.alpha != float("inf")):
            fail("model.lora.alpha", f"must be a positive number, got {self.alpha}")
        for t in self.targets:
            if t in ("router", "gate", "mlp.gate"):
                fail("model.lora.targets", f"{t!r}: the MoE router cannot be a LoRA target (SGLang has no LoRA "
                      "for it, so the engine would route with the base router)")
            if t not in LORA_TARGETS:
                fail("model.lora.targets", f"unknown target {t!r}; choose from {list(LORA_TARGETS)}")
        if len(set(self.targets)) != len(self.targets):
            fail("model.lora.targets", f"lists a target twice: {list(self.targets)}")
        if self.rank and not self.targets:
            fail("model.lora.targets", f"is empty with model.lora.rank={self.rank}: name at least one of "
                  f"{list(LORA_TARGETS)}")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def hf_target_modules(self) -> list[str]:
        """PEFT ``target_modules`` / SGLang ``--lora-target-modules`` of these targets, in a fixed order."""
        names = {n for t in self.targets for n in LORA_HF_MODULES[t]}
        return [n for n in LORA_HF_MODULES["attention"] + LORA_HF_MODULES["experts"] if n in names]


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
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters instead of full fine-tuning (``rank`` > 0)."""

    def __post_init__(self) -> None:
        if self.vocab_divisible_by < 1:
            fail("model.vocab_divisible_by", f"must be >= 1, got {self.vocab_divisible_by}")


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
    """Context parallel size: every sequence split over cp ranks (megatron's load-balanced split into
    2*cp chunks), for long responses. Needs Transformer Engine attention on GPUs and model.dtype=bf16."""
    sequence_parallel: bool = True
    """Sequence parallelism; required for MoE with tp > 1 (megatron-core refuses to train without it)."""
    dispatcher: Dispatcher = Dispatcher.alltoall
    """MoE token dispatcher."""
    world_size: Optional[int] = None
    """Expected number of trainer processes; null means whatever torchrun provides."""
    pp_first_layers: Optional[int] = None
    """Uneven pipeline: transformer layers on the first stage (megatron's
    ``num_layers_in_first_pipeline_stage``); the stages in between split the rest evenly."""
    pp_last_layers: Optional[int] = None
    """Uneven pipeline: transformer layers on the last stage."""
    collective_timeout_s: float = 1800.0
    """Limit of every trainer collective (the world group's timeout). Must exceed
    ``train.batch_timeout_s``: the other ranks wait in the batch broadcast while rank 0 waits for rollouts."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep", "cp"):
            if getattr(self, name) < 1:
                fail(f"parallel.{name}", f"must be >= 1, got {getattr(self, name)}")
        if self.etp is not None and self.etp < 1:
            fail("parallel.etp", f"must be >= 1 or null, got {self.etp}")
        if self.tp > 1 and not self.sequence_parallel:
            fail(
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

    @property
    def local_world_size(self) -> int:
        """Trainer processes ``mrl train`` starts on one machine: ``world_size``, else the smallest world that
        holds both the dense (tp*pp*cp) and the expert (ep*etp*pp) layout."""
        return self.world_size or max(self.tp * self.pp * self.cp, self.ep * self.expert_tp * self.pp)

    def context_parallel_problem(self, *, transformer_engine: bool, gpu: bool) -> str | None:
        """Why ``cp`` > 1 cannot run on this machine, None when it can: megatron-core's context parallelism
        is Transformer Engine's attention (its local attention asserts context_parallel_size == 1), and TE's
        context-parallel attention runs on GPUs only."""
        if self.cp == 1:
            return None
        if not transformer_engine:
            return (f"parallel.cp={self.cp}: context parallelism needs Transformer Engine attention (megatron's "
                    "local attention supports parallel.cp=1 only) and transformer_engine is not installed; "
                    "install it (pip install -e '.[gpu]') or set parallel.cp=1")
        if not gpu:
            return (f"parallel.cp={self.cp}: context parallelism runs Transformer Engine's attention on GPUs and "
                    "this host has none; set parallel.cp=1")
        return None

    def check_world_size(self, world_size: int) -> None:
        """Raise a ValueError naming the fields when the layout does not fit ``world_size`` ranks."""
        mp = self.model_parallel_size
        if world_size % mp:
            fail(
                "parallel.tp/pp/cp",
                f"world size {world_size} is not divisible by tp*pp*cp = {self.tp}*{self.pp}*{self.cp} = {mp}",
            )
        expert_mp = self.ep * self.expert_tp * self.pp
        if world_size % expert_mp:
            fail(
                "parallel.ep/etp/pp",
                f"world size {world_size} is not divisible by ep*etp*pp = "
                f"{self.ep}*{self.expert_tp}*{self.pp} = {expert_mp}",
            )
        if self.world_size is not None and self.world_size != world_size:
            fail("parallel.world_size", f"is {self.world_size} but {world_size} processes were started")

    def stage_layers(self, num_layers: int) -> list[int]:
        """Transformer layers per pipeline stage, megatron's rule (first/last fixed, middle even)."""
        first, last = self.pp_first_layers, self.pp_last_layers
        if first is None and last is None:
            if num_layers % self.pp:
                fail("parallel.pp", f"={self.pp} does not divide the model's {num_layers} layers; set "
                      "parallel.pp_first_layers / parallel.pp_last_layers for an uneven split")
            return [num_layers // self.pp] * self.pp
        for key, n in (("pp_first_layers", first), ("pp_last_layers", last)):
            if n is not None and not 0 < n < num_layers:
                fail(f"parallel.{key}", f"={n} must be in [1, {num_layers - 1}] for a {num_layers}-layer model")
        if self.pp < 2:
            fail("parallel.pp_first_layers", f"an uneven split needs parallel.pp >= 2, got {self.pp}")
        middle_stages = self.pp - (first is not None) - (last is not None)
        middle_layers = num_layers - (first or 0) - (last or 0)
        if middle_layers < 0 or bool(middle_layers) != bool(middle_stages) or (
                middle_stages and middle_layers % middle_stages):
            fail("parallel.pp_first_layers/pp_last_layers",
                  f"first={first} last={last} leave {middle_layers} layers for {middle_stages} middle "
                  f"stage(s) of a {num_layers}-layer model with parallel.pp={self.pp}: not an even split")
        mid = [middle_layers // middle_stages] * middle_stages if middle_stages else []
        return ([first] if first is not None else []) + mid + ([last] if last is not None else [])

    def check_model(self, *, num_experts: int, num_layers: int, num_query_groups: int) -> None:
        """Raise a ValueError naming the fields when the layout cannot shard this model."""
        if num_experts and num_experts % self.ep:
            fail("parallel.ep", f"={self.ep} does not divide the model's {num_experts} experts")
        self.stage_layers(num_layers)
        if self.tp > num_query_groups and self.tp % num_query_groups:
            fail("parallel.tp", f"={self.tp} is neither a divisor nor a multiple of {num_query_groups} KV heads")
        if self.tp <= num_query_groups and num_query_groups % self.tp:
            fail("parallel.tp", f"={self.tp} does not divide the model's {num_query_groups} KV heads")
