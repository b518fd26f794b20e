"""The engines' side of a LoRA run as the config fixes it: which Hugging Face modules the adapters may
target, how the engines are launched (``LoraEngineSpec``) and what they could not serve, refused with the
field named when the config is composed (``lora_engine_spec``). Adapter versions and request routing live
in ``mrl.rollout.lora``. This module imports neither torch nor SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
"""The dense MLPs' linears and, on a MoE model, the routed experts' too: SGLang wraps every fused MoE layer
once gate_up and down are targets, so on its side ``dense_mlp`` and ``experts`` are the same pool."""

# What a trainer-side target may be called -> the Hugging Face leaf names SGLang takes.
_ALIASES = {"attention": ATTENTION, "experts": MLP, "dense_mlp": MLP, "mlp": MLP, "all": ATTENTION + MLP,
            "linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
            "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",),
            **{n: (n,) for n in ATTENTION + MLP}}
_ROUTER = {"router", "gate", "mlp.gate"}
LORA_BACKENDS = ("torch_native", "triton", "csgmv")


def hf_targets(targets: Any, *, key: str = "model.lora.targets") -> tuple[str, ...]:
    """The Hugging Face leaf names (``q_proj`` ...) of a trainer-side target list: group names
    (attention, experts, all), Megatron names (linear_qkv ...) or HF names. The router is refused:
    SGLang has no LoRA for it (``--lora-target-modules`` does not take ``gate``)."""
    items = [targets] if isinstance(targets, str) or not isinstance(targets, Iterable) else list(targets)
    out: list[str] = []
    for t in items:
        t = str(getattr(t, "value", t))
        if t in _ROUTER:
            raise ValueError(f"{key}: {t!r}: SGLang cannot serve LoRA on the MoE router; train it without "
                             "the router (attention and/or expert linears)")
        if t not in _ALIASES:
            raise ValueError(f"{key}: unknown target {t!r}; one of {sorted(_ALIASES)}")
        out += [n for n in _ALIASES[t] if n not in out]
    if not out:
        raise ValueError(f"{key}: no target module")
    return tuple(n for n in ATTENTION + MLP if n in out)


@dataclass(frozen=True, kw_only=True)
class LoraEngineSpec:
    """How every engine of a LoRA run is started. The adapter pool is sized at launch: an adapter of a
    larger rank, or with a module outside ``targets``, is refused at load."""

    max_rank: int
    targets: tuple[str, ...]
    """Hugging Face leaf names (``hf_targets``)."""
    slots: int = 4
    """``--max-loras-per-batch``: adapters one batch may mix, the base model counting as one. A request
    whose adapter finds no free slot waits for one (slower, never wrong). Each slot is preallocated for
    ``max_rank`` over every target of every layer."""
    backend: str | None = None
    """``--lora-backend``; None = torch_native on CPU (the only one without GPU kernels), SGLang's default
    (csgmv) on GPU."""

    def __post_init__(self) -> None:
        if self.max_rank < 1:
            raise ValueError(f"engine.lora_max_rank: must be >= 1, got {self.max_rank}")
        if self.slots < 2:
            raise ValueError(f"engine.lora_slots: must be >= 2 (the base model takes one), got {self.slots}")
        if self.backend not in (None, *LORA_BACKENDS):
            raise ValueError(f"engine.lora_backend: one of {LORA_BACKENDS} or null, got {self.backend!r}")
        hf_targets(self.targets)

    @property
    def experts(self) -> bool:
        return any(t in MLP for t in self.targets)

    def check_engine(self, *, cpu_mode: bool, server_args: dict[str, Any]) -> None:
        """Refuse, naming the field, what an engine of this kind cannot serve."""
        if cpu_mode and self.experts:
            raise ValueError(f"model.lora.targets: {[t for t in self.targets if t in MLP]} on CPU engines: SGLang "
                             "applies MLP/expert LoRA inside the Triton MoE runner, which has no CPU path (the "
                             "first MoE forward crashes); CPU runs train attention targets only")
        if cpu_mode and self.backend not in (None, "torch_native"):
            raise ValueError(f"engine.lora_backend: {self.backend!r} needs GPU kernels; CPU engines take "
                             "torch_native (or null)")
        mine = {"enable_lora", "lora_paths", "max_lora_rank", "lora_target_modules", "max_loras_per_batch",
                "lora_backend", "enable_lora_overlap_loading"}
        if clash := sorted(mine & set(server_args)):
            raise ValueError(f"engine.server_args: {clash} are set by mrl from model.lora and engine.lora_*")
        if server_args.get("max_loaded_loras") is not None:
            raise ValueError("engine.server_args.max_loaded_loras: with LoRA RL every policy version is an "
                             "adapter; over the cap SGLang evicts one, waiting for its requests under its LoRA "
                             "lock, and an adapter loaded from tensors cannot be reloaded after eviction")
        runner = server_args.get("moe_runner_backend")
        if self.experts and not cpu_mode and runner not in (None, "triton"):
            raise ValueError(f"engine.server_args.moe_runner_backend: {runner!r}: expert LoRA runs in SGLang's "
                             "Triton MoE runner only (triton or null)")

    def server_args(self, *, cpu_mode: bool) -> list[str]:
        args = ["--enable-lora", "--max-lora-rank", str(self.max_rank), "--lora-target-modules", *self.targets,
                "--max-loras-per-batch", str(self.slots)]
        backend = self.backend or ("torch_native" if cpu_mode else None)
        if backend:
            args += ["--lora-backend", backend]
        if self.experts and not cpu_mode:
            args += ["--moe-runner-backend", "triton"]
        return args

    def check_adapter(self, config: dict[str, Any], *, where: str = "adapter") -> None:
        """Refuse an adapter config these engines would reject at load, or silently serve differently
        from the trainer (SGLang reads only r, lora_alpha and target_modules)."""
        if str(config.get("peft_type", "")).upper() != "LORA":
            raise ValueError(f"{where}: peft_type {config.get('peft_type')!r}, SGLang serves LORA only")
        r = config.get("r")
        if not isinstance(r, int) or r < 1:
            raise ValueError(f"{where}: r={r!r} must be an int >= 1")
        if r > self.max_rank:
            raise ValueError(f"{where}: rank r={r} > the engines' --max-lora-rank {self.max_rank} "
                             "(engine.lora_max_rank); the engines would refuse it")
        if not isinstance(config.get("lora_alpha"), (int, float)):
            raise ValueError(f"{where}: lora_alpha={config.get('lora_alpha')!r} must be a number")
        for k in ("use_rslora", "use_dora", "rank_pattern", "alpha_pattern", "target_parameters",
                  "modules_to_save", "layers_to_transform"):
            if config.get(k):
                raise ValueError(f"{where}: {k}={config[k]!r}: SGLang ignores it, so the engines would sample "
                                 "from a different policy than the trainer's")
        tm = config.get("target_modules")
        names = [tm] if isinstance(tm, str) else list(tm or [])
        if not names or any(n in ("all", "all-linear") for n in names):
            raise ValueError(f"{where}: target_modules={tm!r}: list the modules (the engines' pool has "
                             f"{list(self.targets)})")
        if outside := sorted(set(names) - set(self.targets)):
            raise ValueError(f"{where}: target_modules {outside} are outside the engines' "
                             f"--lora-target-modules {list(self.targets)} (model.lora.targets at launch)")


def lora_engine_spec(cfg) -> LoraEngineSpec | None:
    """The engines' LoRA spec of a run config (None when ``model.lora`` is off), refusing, with the field
    named, what the engines could not serve. Adapters always reach the engines over HTTP
    (``mrl.weight_sync.adapter``): ``weight_sync.transport`` keeps choosing the path of the base weights,
    which a LoRA run never changes after launch, so every transport is accepted (``disk`` also writes
    each adapter to ``weight_sync.export_dir`` and has the engines load it from there)."""
    lora = getattr(cfg.model, "lora", None)
    if lora is None or not getattr(lora, "enabled", True) or not (getattr(lora, "rank", 0) or 0):
        return None
    e = cfg.engine
    rank = int(lora.rank)
    max_rank = e.lora_max_rank if e.lora_max_rank is not None else rank
    if rank > max_rank:
        raise ValueError(f"model.lora.rank: {rank} > engine.lora_max_rank {max_rank}, the engines' "
                         "--max-lora-rank: they would refuse every adapter")
    spec = LoraEngineSpec(max_rank=max_rank, targets=hf_targets(lora.targets), slots=e.lora_slots,
                          backend=e.lora_backend)
    spec.check_engine(cpu_mode=e.cpu_mode, server_args=dict(e.server_args))
    if e.dp > 1:
        raise ValueError("engine.dp: SGLang loads adapters only into servers with dp_size 1 (an "
                         "assert in its LoRA endpoints); start more engines instead")
    return spec
