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

from mrl.config.lora_engine import lora_engine_spec


class DType(str, enum.Enum):
    fp32 = "fp32"
    bf16 = "bf16"


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
    tiny_lora = "tiny_lora"  # tiny with its output head x10 (std 0.2): a base LoRA can adapt (mrl/models/tiny.py)


def _fail(key: str, msg: str) -> None:
    raise ValueError(f"{key}: {msg}")


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
            _fail("model.lora.rank", f"must be >= 0 (0 = off), got {self.rank}")
        if not (self.alpha > 0 and self.alpha != float("inf")):
            _fail("model.lora.alpha", f"must be a positive number, got {self.alpha}")
        for t in self.targets:
            if t in ("router", "gate", "mlp.gate"):
                _fail("model.lora.targets", f"{t!r}: the MoE router cannot be a LoRA target (SGLang has no LoRA "
                      "for it, so the engine would route with the base router)")
            if t not in LORA_TARGETS:
                _fail("model.lora.targets", f"unknown target {t!r}; choose from {list(LORA_TARGETS)}")
        if len(set(self.targets)) != len(self.targets):
            _fail("model.lora.targets", f"lists a target twice: {list(self.targets)}")
        if self.rank and not self.targets:
            _fail("model.lora.targets", f"is empty with model.lora.rank={self.rank}: name at least one of "
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

    @property
    def local_world_size(self) -> int:
        """Trainer processes ``mrl train`` starts on one machine: ``world_size``, else the smallest world that
        holds both the dense (tp*pp*cp) and the expert (ep*etp*pp) layout."""
        return self.world_size or max(self.tp * self.pp * self.cp, self.ep * self.expert_tp * self.pp)

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

    def stage_layers(self, num_layers: int) -> list[int]:
        """Transformer layers per pipeline stage, megatron's rule (first/last fixed, middle even)."""
        first, last = self.pp_first_layers, self.pp_last_layers
        if first is None and last is None:
            if num_layers % self.pp:
                _fail("parallel.pp", f"={self.pp} does not divide the model's {num_layers} layers; set "
                      "parallel.pp_first_layers / parallel.pp_last_layers for an uneven split")
            return [num_layers // self.pp] * self.pp
        for key, n in (("pp_first_layers", first), ("pp_last_layers", last)):
            if n is not None and not 0 < n < num_layers:
                _fail(f"parallel.{key}", f"={n} must be in [1, {num_layers - 1}] for a {num_layers}-layer model")
        if self.pp < 2:
            _fail("parallel.pp_first_layers", f"an uneven split needs parallel.pp >= 2, got {self.pp}")
        middle_stages = self.pp - (first is not None) - (last is not None)
        middle_layers = num_layers - (first or 0) - (last or 0)
        if middle_layers < 0 or bool(middle_layers) != bool(middle_stages) or (
                middle_stages and middle_layers % middle_stages):
            _fail("parallel.pp_first_layers/pp_last_layers",
                  f"first={first} last={last} leave {middle_layers} layers for {middle_stages} middle "
                  f"stage(s) of a {num_layers}-layer model with parallel.pp={self.pp}: not an even split")
        mid = [middle_layers // middle_stages] * middle_stages if middle_stages else []
        return ([first] if first is not None else []) + mid + ([last] if last is not None else [])

    def check_model(self, *, num_experts: int, num_layers: int, num_query_groups: int) -> None:
        """Raise a ValueError naming the fields when the layout cannot shard this model."""
        if num_experts and num_experts % self.ep:
            _fail("parallel.ep", f"={self.ep} does not divide the model's {num_experts} experts")
        self.stage_layers(num_layers)
        if self.tp > num_query_groups and self.tp % num_query_groups:
            _fail("parallel.tp", f"={self.tp} is neither a divisor nor a multiple of {num_query_groups} KV heads")
        if self.tp <= num_query_groups and num_query_groups % self.tp:
            _fail("parallel.tp", f"={self.tp} does not divide the model's {num_query_groups} KV heads")


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
    (``mrl.rollout.cpu_attention``) instead of looping over sequences in Python, which made a CPU
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
    """GPU: SGLang attention backend; null = fa3 where SGLang's kernels ship it, else triton."""
    sampling_backend: Optional[str] = None
    """GPU: SGLang sampling backend (pytorch | flashinfer); null = pytorch with ``train.sampling_mask``
    (the support it rebuilds is the pytorch sampler's), else SGLang's default."""
    engine_dtype: Optional[str] = None
    """Engine weights dtype, also the dtype weights are synced in (bfloat16, float16, float32); null =
    the trainer's ``model.dtype``. CPU mode runs float32 only."""
    max_total_tokens: Optional[int] = None
    """KV-cache tokens per engine; null = 4096 in CPU mode, sized from ``mem_fraction_static`` on GPU."""
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


class AdvEstimator(str, enum.Enum):
    """How scalar rewards become per-sample advantages (``mrl.algo.advantages``)."""

    grpo = "grpo"  # (r - group mean) / (group std + adv_eps); std division optional (Dr. GRPO)
    rloo = "rloo"  # r - mean of the other samples of the group (leave-one-out)


class LossType(str, enum.Enum):
    """Importance ratio of the clipped surrogate (``mrl.algo.losses``)."""

    grpo = "grpo"  # per-token ratio pi/pi_old, PPO clip
    dapo = "dapo"  # same surrogate as grpo; DAPO is its settings: clip-higher, token_mean, dynamic sampling, overlong
    gspo = "gspo"  # per-sequence ratio exp(mean_t log(pi/pi_old)), clipped per sequence


class Aggregation(str, enum.Enum):
    """How per-token losses reduce to one scalar (``mrl.algo.aggregation``)."""

    token_mean = "token_mean"  # sum over tokens / tokens in the batch (DAPO)
    seq_mean_token_mean = "seq_mean_token_mean"  # mean over sequences of each one's token mean (GRPO)
    seq_mean_token_sum_norm = "seq_mean_token_sum_norm"  # mean over seqs of token sum / max_response_len (Dr. GRPO)


class Correction(str, enum.Enum):
    """Off-policy correction with w = pi_old / pi_behav (``mrl.algo.correction``)."""

    none = "none"
    tis = "tis"  # truncated IS: loss_t * min(w, is_cap)
    mis = "mis"  # masked IS: loss_t * w if w in [mis_low, mis_high] else 0; token or sequence level
    icepop = "icepop"  # IcePop: loss_t * w if w in [icepop_low, icepop_high] else 0; token level


class CorrectionLevel(str, enum.Enum):
    token = "token"  # one w per token
    sequence = "sequence"  # one w per sequence: geometric mean exp(mean_t log w_t)


class KLEstimator(str, enum.Enum):
    """Schulman's per-token estimators of KL(pi || pi_ref) (``mrl.algo.kl``)."""

    k1 = "k1"  # log(pi / pi_ref)
    k2 = "k2"  # 0.5 * log(pi_ref / pi)^2
    k3 = "k3"  # pi_ref / pi - 1 - log(pi_ref / pi)


@dataclass(kw_only=True)
class AlgoConfig:
    """RL algorithm: advantage estimator, policy loss, off-policy correction, KL; defaults are GRPO.

    Logprob names used below: ``logp`` = current trainer policy pi; ``old_logp`` = trainer recompute
    before this step's updates (pi_old); ``behav_logp`` = the SGLang engine's logprobs of the tokens it
    sampled (pi_behav, possibly several weight versions old and numerically different from the
    trainer). The PPO ratio is pi/pi_old; the correction weight w = pi_old/pi_behav covers staleness
    and train/inference mismatch. conf/algo/{grpo,dapo,gspo}.yaml hold the presets.
    """

    adv_estimator: AdvEstimator = AdvEstimator.grpo
    """Advantage estimator."""
    std_normalize: bool = True
    """GRPO only: divide by the group std; false = Dr. GRPO (centred rewards only)."""
    adv_eps: float = 1e-6
    """Added to the group std before dividing."""
    loss: LossType = LossType.grpo
    """Policy-loss ratio: per token (grpo, dapo) or per sequence (gspo)."""
    clip_low: float = 0.2
    """Ratio lower clip: 1 - clip_low (GRPO/DAPO 0.2; GSPO 3e-4)."""
    clip_high: float = 0.2
    """Ratio upper clip: 1 + clip_high (GRPO 0.2; DAPO clip-higher 0.28; GSPO 4e-4)."""
    dual_clip: Optional[float] = None
    """Dual-clip c > 1: for A < 0 the per-token loss is capped at -c*A; null = off."""
    aggregation: Aggregation = Aggregation.seq_mean_token_mean
    """Reduction of per-token losses (GRPO: seq_mean_token_mean; DAPO: token_mean)."""
    max_response_len: Optional[int] = None
    """L_max for seq_mean_token_sum_norm and overlong shaping; the presets set ${rollout.max_new_tokens}."""
    correction: Correction = Correction.tis
    """Off-policy correction against the engine's (behaviour) logprobs."""
    correction_level: CorrectionLevel = CorrectionLevel.token
    """Per-token or per-sequence (geometric mean) weight for tis and mis; icepop is per token."""
    is_cap: float = 2.0
    """TIS truncation C: weight = min(w, C)."""
    mis_low: float = 0.5
    """MIS band: tokens (or sequences) with w outside [mis_low, mis_high] get weight 0."""
    mis_high: float = 2.0
    icepop_low: float = 0.5
    """IcePop band [alpha, beta]: tokens with w outside it get weight 0 (zero gradient)."""
    icepop_high: float = 2.0
    kl_coef: float = 0.0
    """Weight of the KL-to-reference term; > 0 needs the reference model's logprobs."""
    kl_estimator: KLEstimator = KLEstimator.k3
    """Per-token KL estimator for the reference term."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal (zero advantage) and sample more."""
    overlong_shaping: bool = False
    """DAPO soft overlong punishment added to the reward: 0 up to max_response_len - overlong_buffer_len,
    linear to -1 at max_response_len, -1 beyond."""
    overlong_buffer_len: int = 8
    """DAPO's L_cache (the paper: 4096 of 20480)."""
    lr: float = 1e-5
    """Adam learning rate of the trainer."""

    def __post_init__(self) -> None:
        if not 0.0 < self.clip_low < 1.0:
            _fail("algo.clip_low", f"must be in (0, 1), got {self.clip_low}")
        if self.clip_high <= 0.0:
            _fail("algo.clip_high", f"must be > 0, got {self.clip_high}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            _fail("algo.dual_clip", f"must be > 1 or null, got {self.dual_clip}")
        if self.adv_eps < 0.0:
            _fail("algo.adv_eps", f"must be >= 0, got {self.adv_eps}")
        if self.max_response_len is not None and self.max_response_len < 1:
            _fail("algo.max_response_len", f"must be >= 1 or null, got {self.max_response_len}")
        if self.is_cap <= 0.0:
            _fail("algo.is_cap", f"must be > 0, got {self.is_cap}")
        for name in ("mis", "icepop"):
            low, high = getattr(self, f"{name}_low"), getattr(self, f"{name}_high")
            if not 0.0 <= low <= 1.0 <= high:
                _fail(f"algo.{name}_low/{name}_high", f"must satisfy 0 <= low <= 1 <= high, got [{low}, {high}]")
        if self.correction is Correction.icepop and self.correction_level is CorrectionLevel.sequence:
            _fail("algo.correction_level", "icepop is per token; use correction=mis for a per-sequence mask")
        if self.kl_coef < 0.0:
            _fail("algo.kl_coef", f"must be >= 0, got {self.kl_coef}")
        if self.aggregation is Aggregation.seq_mean_token_sum_norm and self.max_response_len is None:
            _fail("algo.max_response_len", "must be set for aggregation=seq_mean_token_sum_norm")
        if self.overlong_shaping:
            if self.max_response_len is None:
                _fail("algo.max_response_len", "must be set for overlong_shaping")
            if not 0 < self.overlong_buffer_len <= self.max_response_len:
                _fail(
                    "algo.overlong_buffer_len",
                    f"must be in [1, max_response_len={self.max_response_len}], got {self.overlong_buffer_len}",
                )
        if self.lr <= 0.0:
            _fail("algo.lr", f"must be > 0, got {self.lr}")


class BadRowPolicy(str, enum.Enum):
    """What a JSONL dataset does with a malformed row."""

    skip = "skip"    # skip it, counted per reason in the dataset's stats
    error = "error"  # raise a ValueError naming file:line


@dataclass(kw_only=True)
class DataConfig:
    """Prompt source: a built-in synthetic task (``task``) or a JSONL file (``path``)."""

    task: str = "reverse"
    """Built-in synthetic task (``mrl.data.tasks.TASKS``: reverse, add_mod, copy_last), or ``jsonl``
    (the ``data=jsonl`` preset), which requires ``path``. Unused when ``path`` is set."""
    path: Optional[str] = None
    """JSONL prompt file, one JSON object per line; replaces ``task`` when set."""
    eval_path: Optional[str] = None
    """Held-out JSONL file (only with ``path``; built-in tasks hold out ``eval_fraction`` of their inputs)."""
    prompt_key: str = "prompt"
    """JSONL field with the prompt text (a non-empty string)."""
    answer_key: Optional[str] = "answer"
    """JSONL field with the label the reward needs (string or number); null when the reward needs none."""
    id_key: str = "id"
    """JSONL field used as the prompt id when a row has it; otherwise the id is ``<file name>:<line>``."""
    on_bad_row: BadRowPolicy = BadRowPolicy.skip
    """Malformed JSONL rows (invalid JSON, missing key, wrong type, empty prompt): skip and count, or raise."""
    shuffle: bool = True
    """Visit prompts in a seeded random order, reshuffled each epoch (``seed`` + epoch)."""
    seed: int = 1234
    """Seed of the prompt order (and of nothing else)."""
    eval_fraction: float = 0.2
    """Built-in tasks: fraction of the input space held out for eval (a fixed hash of each input)."""
    task_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the task's constructor, e.g. ``+data.task_args.max_len=4`` for reverse."""
    apply_chat_template: bool = True
    """Wrap prompts in the tokenizer's chat template when it has one (the tiny model's has none)."""

    def __post_init__(self) -> None:
        if not self.task:
            _fail("data.task", "must name a built-in task")
        if self.path == "":
            _fail("data.path", "must be a JSONL file path or null")
        if self.task == "jsonl" and self.path is None:
            _fail("data.path", "must be set for data.task=jsonl (data=jsonl data.path=FILE.jsonl)")
        if self.eval_path is not None and self.path is None:
            _fail("data.eval_path", "is only used with data.path (built-in tasks hold out data.eval_fraction)")
        if self.path is not None and self.task_args:
            _fail("data.task_args", "is set but unused: data.path replaces the built-in task")
        if not self.prompt_key:
            _fail("data.prompt_key", "must be a non-empty field name")
        if self.answer_key == "":
            _fail("data.answer_key", "must be a non-empty field name or null")
        if not 0.0 < self.eval_fraction < 1.0:
            _fail("data.eval_fraction", f"must be in (0, 1), got {self.eval_fraction}")


class RewardExecutor(str, enum.Enum):
    thread = "thread"    # quick or GIL-releasing reward fns
    process = "process"  # CPU-heavy verifiers; each worker re-imports the fn by its dotted path
    auto = "auto"        # thread for mrl's built-ins, process for any other fn (a hung one can be stopped)


# "raise" is a keyword, hence the functional form (OmegaConf matches member names).
RewardOnError = enum.Enum("RewardOnError", [("zero", "zero"), ("drop", "drop"), ("raise", "raise")], type=str)
RewardOnError.__doc__ = "A reward call that raised or timed out: score error_value, drop the sample, or raise."


@dataclass(kw_only=True)
class RewardConfig:
    """Reward function by dotted path, scored asynchronously (``mrl.reward.RewardScorer``)."""

    fn: str = "mrl.reward.builtin.exact_match"
    """Dotted path of ``fn(prompt: Prompt, response_text: str) -> float`` (a def or an async def)."""
    executor: RewardExecutor = RewardExecutor.auto
    """Where calls run: a thread pool, or a process pool for CPU-heavy verifiers; ``auto``: threads for
    ``mrl.reward.builtin`` fns, processes for user fns (a call past ``timeout_s`` can only be stopped there)."""
    num_workers: int = 4
    """Concurrent reward calls (threads or processes)."""
    timeout_s: Optional[float] = 30.0
    """Per-call limit, counted from when a worker takes the call; null for none."""
    on_error: RewardOnError = RewardOnError.zero
    """A call that raised, timed out or returned a non-number: ``zero`` scores ``error_value``,
    ``drop`` drops the sample, ``raise`` stops the run. Always counted."""
    error_value: float = 0.0
    """Reward of a failed call under ``on_error=zero``."""
    max_error_rate: float = 0.5
    """The run stops, naming the fn and its last error, once more than this share of the last 64 calls
    failed (raised, timed out, returned a non-number); 1 = never."""

    def __post_init__(self) -> None:
        if "." not in self.fn.strip("."):
            _fail("reward.fn", f"must be a dotted path 'package.module.function', got {self.fn!r}")
        if self.num_workers < 1:
            _fail("reward.num_workers", f"must be >= 1, got {self.num_workers}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            _fail("reward.timeout_s", f"must be > 0 or null, got {self.timeout_s}")
        if not abs(self.error_value) < float("inf"):  # also catches nan
            _fail("reward.error_value", f"must be finite, got {self.error_value}")
        if not 0.0 <= self.max_error_rate <= 1.0:
            _fail("reward.max_error_rate", f"must be in [0, 1], got {self.max_error_rate}")


class WeightTransport(str, enum.Enum):
    distributed = "distributed"  # update_weights_from_distributed: NCCL (GPU) / gloo (CPU) broadcast
    disk = "disk"  # safetensors export + update_weights_from_disk (also the repair path)
    tensor = "tensor"  # colocated GPUs: CUDA IPC handles via update_weights_from_tensor


@dataclass(kw_only=True)
class WeightSyncConfig:
    """Trainer -> engine weight sync."""

    transport: WeightTransport = WeightTransport.distributed
    bucket_mb: float = 512
    """Upper bound of one streamed bucket (a single larger tensor gets a bucket of its own)."""
    every_n_steps: int = 1
    """Push new weights to the engines after every N optimizer steps."""
    export_dir: Optional[str] = None
    """Where the disk transport / repair path writes safetensors (engines must read it); null = run_dir/weights."""
    timeout_s: float = 300.0
    """Limit for each weight-update collective and HTTP call."""
    probe_timeout_s: float = 15.0
    """Limit of the liveness probe (``GET /model_info``) that tells a hung engine from a slow one: one that
    fails a sync step, does not answer a control call within a second, or has had rollout requests in flight
    this long without answering any, is probed; no answer within this limit (or a 5xx to each of 3 probes)
    and it is dropped like a killed one -- its requests resume on the others, the job's own engines are
    killed and replaced (``rollout.restart_engines``)."""
    verify: Optional[bool] = None
    """After every sync, compare engine and trainer logprobs of a fixed probe (both routing naturally); over
    ``verify_tol`` stops the run naming the engines. null = on for float32 engines, off for bf16/fp16 ones,
    whose natural routing flips experts on near ties and makes a max-difference probe unreliable."""
    verify_tol: float = 1e-3
    """Max abs logprob difference the probe accepts (fp32); bf16 runs need ~0.1."""
    master_address: Optional[str] = None
    """The address engines dial to join a trainer rank's weight-update group (the rank hosts its store).
    null = each sending rank's own address on the interface that routes to the engines, which is right on
    one node and across nodes; set it only when that route is not the one engines can reach it by."""

    def __post_init__(self) -> None:
        if self.bucket_mb <= 0:
            _fail("weight_sync.bucket_mb", f"must be > 0, got {self.bucket_mb}")
        if self.every_n_steps < 1:
            _fail("weight_sync.every_n_steps", f"must be >= 1, got {self.every_n_steps}")
        if self.timeout_s <= 0:
            _fail("weight_sync.timeout_s", f"must be > 0, got {self.timeout_s}")
        if self.probe_timeout_s <= 0:
            _fail("weight_sync.probe_timeout_s", f"must be > 0, got {self.probe_timeout_s}")


class ClusterKind(str, enum.Enum):
    local = "local"  # this machine: torchrun ranks and local SGLang subprocesses (``mrl train``)
    slurm = "slurm"  # one Slurm job written and submitted by ``mrl launch``


class ContainerKind(str, enum.Enum):
    """How the per-node steps of a Slurm job enter the cluster image (docker/)."""

    none = "none"  # the host environment (e.g. a virtualenv on shared storage)
    pyxis = "pyxis"  # srun --container-image=... (enroot; image = .sqsh path or registry image)
    apptainer = "apptainer"  # apptainer exec image.sif ...


@dataclass(kw_only=True)
class ClusterConfig:
    """Where processes run: this machine, or one Slurm allocation split into engine and trainer nodes.

    Slurm layout (``mrl launch``, mrl/cluster/): the first ``num_rollout_nodes`` nodes run ``mrl engine``
    (``rollout.num_engines / num_rollout_nodes`` engines each), the next ``num_train_nodes`` run the
    trainer (``nproc_per_node`` ranks each). ``num_rollout_nodes=0``: no engine nodes, the trainer starts
    its engines itself on its node, as a local run does (CPU runs, colocated GPU runs).
    """

    kind: ClusterKind = ClusterKind.local
    nproc_per_node: int = 1
    """Trainer processes per trainer node (torchrun --nproc-per-node); on GPU nodes usually gpus_per_node."""
    num_train_nodes: int = 1
    num_rollout_nodes: int = 1
    """Engine nodes, first in the allocation; 0 = engines started by the trainer on its own node."""
    gpus_per_node: int = 8
    """sbatch --gpus-per-node (0 = CPU nodes: no GPU request, no apptainer --nv)."""
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    time: str = "04:00:00"
    """Wall-clock limit (sbatch --time)."""
    job_name: str = "mrl"
    exclusive: bool = True
    """Whole nodes (sbatch --exclusive): no other job's processes or /dev/shm files next to ours."""
    sbatch_args: list[str] = field(default_factory=list)
    """Extra sbatch options, one per entry (``--constraint=h100``, ``--mem=0``)."""
    srun_args: list[str] = field(default_factory=list)
    """Extra options of every srun step (``--mpi=pmix``, ``--cpu-bind=none``)."""
    hetjob: bool = False
    """Heterogeneous job: engine nodes and trainer nodes as two components, for pools that need different
    partitions or node types. Both components must be free at once; one allocation schedules sooner."""
    rollout_partition: Optional[str] = None
    """hetjob only: partition of the engine component (null: ``partition``)."""
    rollout_gpus_per_node: Optional[int] = None
    """hetjob only: GPUs per engine node (null: ``gpus_per_node``)."""
    rollout_sbatch_args: list[str] = field(default_factory=list)
    """hetjob only: extra sbatch options of the engine component."""
    container: ContainerKind = ContainerKind.none
    image: Optional[str] = None
    """pyxis: squashfs path (must start with / or ./) or registry image; apptainer: .sif path."""
    container_mounts: list[str] = field(default_factory=list)
    """``src:dst[:flags]`` besides the run directory (always mounted at its own path): models, data."""
    container_workdir: str = "/opt/mrl"
    """Working directory inside the image (where docker/Dockerfile installs mrl)."""
    python: Optional[str] = None
    """Interpreter that runs ``-m mrl`` on the nodes; null: the launcher's own interpreter without a
    container (a virtualenv on shared storage), ``python`` inside one."""
    setup: list[str] = field(default_factory=list)
    """Shell lines the batch script runs before the steps start (``module load cuda``, ``source env.sh``)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment of every step (``CUDA_DEVICE_MAX_CONNECTIONS``, NCCL settings). Never secrets: those go in
    ``$RUN_DIR/secrets.env`` (mode 0600), which the batch script sources."""
    signal_seconds: int = 600
    """USR1 this many seconds before the time limit: the trainer checkpoints and the job requeues (0 = off)."""
    max_restarts: int = 10
    """Requeues after USR1 before the job ends instead."""

    def __post_init__(self) -> None:
        for name, low in (("nproc_per_node", 1), ("num_train_nodes", 1), ("num_rollout_nodes", 0),
                          ("gpus_per_node", 0), ("signal_seconds", 0), ("max_restarts", 0)):
            if getattr(self, name) < low:
                _fail(f"cluster.{name}", f"must be >= {low}, got {getattr(self, name)}")
        if self.container != ContainerKind.none and not self.image:
            _fail("cluster.image", f"must be set for cluster.container={self.container.value}")
        if self.hetjob and self.num_rollout_nodes < 1:
            _fail("cluster.hetjob", "needs cluster.num_rollout_nodes >= 1 (the engine component)")
        for name in ("rollout_partition", "rollout_gpus_per_node", "rollout_sbatch_args"):
            if getattr(self, name) not in (None, []) and not self.hetjob:
                _fail(f"cluster.{name}", "applies to heterogeneous jobs only: set cluster.hetjob=true "
                      "(one allocation has one partition and one node type)")


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


class StalePolicy(str, enum.Enum):
    drop = "drop"  # samples older than max_staleness are dropped (counted)
    keep = "keep"  # kept; the off-policy correction (algo.correction) weighs them


@dataclass(kw_only=True)
class TrainConfig:
    """The RL loop (mrl/train.py): steps, batch shape, staleness, warm start, logging, checkpoints."""

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
    """Adam moments (and master-weight storage). bf16: megatron's precision-aware optimizer, 8 bytes per
    parameter less; needs Transformer Engine on GPUs."""
    lr_warmup_steps: int = 0
    eval_every: int = 10
    """Greedy accuracy on the held-out split every N steps (0 = never)."""
    eval_prompts: int = 32
    routing_metrics_every: int = 1
    """A natural-routing (record) forward every N steps: disagreement and replay-on/off KL."""
    save_every: int = 0
    """Checkpoint (megatron dist_checkpointing + loop state) every N steps; 0 = only on SIGUSR1/end."""
    keep_checkpoints: int = 0
    """Keep the newest N complete checkpoints: older ones are deleted once a newer one is complete (its
    files synced to disk before its marker is written); 0 = keep every one."""
    resume: bool = True
    """Resume from the newest checkpoint in run_dir/checkpoints if there is one."""
    stop_after: Optional[int] = None
    """Stop (after checkpointing) once this step is done: for tests of resume."""
    replay: bool = True
    """Keep Routing: replay the engine's experts in training."""
    bad_routes: BadRoutes = BadRoutes.error
    """A sample whose routes are missing or mis-sized: never trained with wrong routing."""
    packing: bool = True
    """Sequence packing: several samples per row (first-fit decreasing) so long-tailed batches waste no
    padding; ``micro_batch_size`` then counts packed rows. Megatron's local attention gets a
    block-diagonal causal mask (verified equal to unpacked), the Transformer Engine spec THD
    ``cu_seqlens`` (TE's fused attention; run on GPUs)."""
    pack_max_len: Optional[int] = None
    """Packed row length in tokens; null = the step's longest sample (rounded up to a multiple of tp)."""
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

    def __post_init__(self) -> None:
        for name in ("steps", "prompts_per_step", "micro_batch_size", "max_inflight_groups", "sft_batch"):
            if getattr(self, name) < 1:
                _fail(f"train.{name}", f"must be >= 1, got {getattr(self, name)}")
        if self.max_staleness < 0:
            _fail("train.max_staleness", f"must be >= 0, got {self.max_staleness}")
        if self.gc_interval < 0:
            _fail("train.gc_interval", f"must be >= 0 (0 = Python's automatic collection), got {self.gc_interval}")
        if self.max_nonfinite_steps < 0:
            _fail("train.max_nonfinite_steps", f"must be >= 0, got {self.max_nonfinite_steps}")
        if self.keep_checkpoints < 0:
            _fail("train.keep_checkpoints", f"must be >= 0 (0 keeps every checkpoint), got {self.keep_checkpoints}")
        if self.pack_max_len is not None and self.pack_max_len < 2:
            _fail("train.pack_max_len", f"must be >= 2 or null, got {self.pack_max_len}")


_ENGINE_DTYPES = {DType.fp32: "float32", DType.bf16: "bfloat16"}


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
            _fail("tracking.project", "must be a non-empty name")
        if self.run_name == "":
            _fail("tracking.run_name", "must be a non-empty name or null")


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
        if self.model.lora.enabled:  # what the engines could not serve, refused now rather than at launch
            lora_engine_spec(self)
        if self.parallel.collective_timeout_s <= self.train.batch_timeout_s:
            _fail("parallel.collective_timeout_s", f"={self.parallel.collective_timeout_s} must exceed "
                  f"train.batch_timeout_s={self.train.batch_timeout_s}: trainer ranks other than 0 wait in the "
                  "batch broadcast while rank 0 waits for rollouts")
