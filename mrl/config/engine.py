"""The ``engine:`` node: the SGLang servers a run samples from, how many, where they run, how they are
launched and restarted (``mrl.engine.launcher``). What is asked of them (sampling, the multi-turn
environment) is the ``rollout:`` node (``mrl.config.schema.RolloutConfig``). Checks that need another node
(the trainer's dtype, LoRA, the weight-sync transport) live in ``Config.__post_init__``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from mrl.config.base import fail as _fail

ENGINE_QUANTIZATIONS = (None, "fp8")
"""``engine.quantization``: null (the engine dtype) or block-wise FP8 (mrl.quant.fp8)."""
KV_CACHE_DTYPES = (None, "fp8_e4m3", "fp8_e5m2", "bfloat16")
"""``engine.kv_cache_dtype``: SGLang's ``--kv-cache-dtype`` choices mrl passes (null = SGLang's auto)."""


@dataclass(kw_only=True)
class EngineConfig:
    """The SGLang engine pool: size, placement, launch flags, restarts."""

    count: int = 1
    """SGLang servers (one per DP replica)."""
    tp: int = 1
    """Tensor-parallel ranks of one server."""
    ep: int = 1
    """Expert-parallel ranks of one server."""
    dp: int = 1
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
    """GPU: first GPU of the first engine on a node; engine i takes the ``tp * dp`` GPUs that follow
    ``base_gpu_id + i * tp * dp``. null = the GPUs after the trainer ranks' on this node (``mrl train`` on
    one node of N GPUs: trainer on the first ones, engines on the rest)."""
    mem_fraction_static: Optional[float] = None
    """GPU: share of each engine GPU's memory for weights and KV cache (null: SGLang's own choice)."""
    attention_backend: Optional[str] = None
    """GPU: SGLang attention backend (triton | fa3 | flashinfer); null = triton. ``fa3`` starts the engines
    without SGLang's prefill CUDA graphs, whose capture faults with FA3 in SGLang 0.5.14 (docs/gpu.md), unless
    ``server_args`` decides them."""
    sampling_backend: Optional[str] = None
    """GPU: SGLang sampling backend (pytorch | flashinfer); null = pytorch with ``train.sampling_mask``
    (the support it rebuilds is the pytorch sampler's), else SGLang's default."""
    dtype: Optional[str] = None
    """Engine weights dtype, also the dtype weights are synced in (bfloat16, float16, float32); null =
    the trainer's ``model.dtype``. CPU mode runs float32 only."""
    max_total_tokens: Optional[int] = None
    """KV-cache tokens per engine; null = 4096 in CPU mode, sized from ``mem_fraction_static`` on GPU."""
    quantization: Optional[str] = None
    """GPU engines' weights: null = ``dtype``; ``fp8`` = block-wise FP8 (e4m3, one scale per 128x128
    block, SGLang's ``fp8`` method): attention, MLP and expert projections in FP8, norms, router,
    embeddings and head in ``dtype``. The engines start from ``<run_dir>/fp8_model``, the block-FP8
    export of ``model.hf_path`` made once per run, and the trainer (bf16) quantizes at every weight sync
    (``mrl.quant``, docs/fp8.md). Not in CPU mode (SGLang's CPU FP8 kernels need AMX and a bf16 engine),
    not with LoRA."""
    compile_cache_dir: Optional[str] = "~/.cache/mrl/compile"
    """GPU engines: where torch inductor and triton keep what they compile at start (prefill CUDA graphs,
    kernels), so the next run's engines start warm; put it on storage the nodes share and keep. null:
    their defaults (inductor's under /tmp). The caller's ``TORCHINDUCTOR_CACHE_DIR`` / ``TRITON_CACHE_DIR``
    win."""
    fp8_ignore: list[str] = field(default_factory=list)
    """``quantization=fp8``: modules kept in ``dtype`` on top of the rule (norms, router, embeddings and
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
    max_restarts: int = 3
    """Replacements the job may start, in all, for engines it started that die (0 = none); a replacement
    joins at the first weight sync after it is healthy. Engines attached by URL are never restarted."""
    server_args: dict[str, Any] = field(default_factory=dict)
    """Extra ``sglang.launch_server`` flags, passed through (``+engine.server_args.x=1``)."""
    urls: list[str] = field(default_factory=list)
    """Attach to already-running engines (http://host:port) instead of starting them."""
    url_dir: Optional[str] = None
    """Attach to engines that announce themselves as ``<dir>/<name>.url`` files (written by
    ``mrl engine`` on cluster engine nodes); waits for ``count`` of them."""
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
        self._check_pool()
        self._check_weights()
        self._check_lora()

    def _check_pool(self) -> None:
        if self.count < 1:
            _fail("engine.count", f"must be >= 1, got {self.count}")
        if self.max_restarts < 0:
            _fail("engine.max_restarts", f"must be >= 0, got {self.max_restarts}")
        if self.max_running_requests < 1:
            _fail("engine.max_running_requests", f"must be >= 1, got {self.max_running_requests}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            _fail("engine.cpu_threads", f"must be >= 1 or null, got {self.cpu_threads}")
        if self.cpus is not None and (not self.cpus or min(self.cpus) < 0):
            _fail("engine.cpus", f"={list(self.cpus)}: give a non-empty list of core ids, or null")
        if self.base_gpu_id is not None and self.base_gpu_id < 0:
            _fail("engine.base_gpu_id", f"must be >= 0 or null, got {self.base_gpu_id}")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            _fail("engine.mem_fraction_static", f"must be in (0, 1) or null, got {self.mem_fraction_static}")
        if self.sampling_backend not in (None, "pytorch", "flashinfer"):
            _fail("engine.sampling_backend", f"must be pytorch, flashinfer or null, got {self.sampling_backend!r}")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            _fail("engine.max_total_tokens", f"must be >= 1 or null, got {self.max_total_tokens}")
        if self.moe_kernel_configs is not None and self.cpu_mode:
            _fail("engine.moe_kernel_configs", "tunes SGLang's triton fused-MoE kernel of GPU engines; CPU "
                  "engines do not run it: set it to null")

    def _check_weights(self) -> None:
        if self.dtype not in (None, "bfloat16", "float16", "float32"):
            _fail("engine.dtype", f"must be bfloat16, float16, float32 or null, got {self.dtype!r}")
        if self.quantization not in ENGINE_QUANTIZATIONS:
            _fail("engine.quantization", f"must be one of {list(ENGINE_QUANTIZATIONS)}, got {self.quantization!r}")
        for key in ("quantization", "kv_cache_dtype"):
            if key in self.server_args:  # the fields also choose the checkpoint and what the weight sync sends
                _fail(f"engine.server_args.{key}", f"set engine.{key} instead (the engines' checkpoint and the "
                      "weight sync follow it; a server flag alone would not)")
        if self.quantization is not None and self.cpu_mode:
            _fail("engine.quantization", f"={self.quantization}: CPU engines cannot serve block-FP8 weights (SGLang "
                  "0.5.14's CPU FP8 layers need AMX and the sgl-kernel CPU build, and mrl's CPU engines run float32, "
                  "which SGLang's fp8 method refuses); use GPU engines (engine=gpu) or null")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            _fail("engine.kv_cache_dtype", f"must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.fp8_ignore and self.quantization != "fp8":
            _fail("engine.fp8_ignore", f"={list(self.fp8_ignore)} keeps modules out of FP8, but "
                  f"engine.quantization={self.quantization}: set quantization=fp8 or leave the list empty")
        bad = [m for m in self.fp8_ignore if not isinstance(m, str) or not m.strip(". ") or any(c.isspace() for c in m)]
        if bad:
            _fail("engine.fp8_ignore", f"entries must be dotted module paths (e.g. model.layers.0.self_attn), "
                  f"got {bad}")

    def _check_lora(self) -> None:
        if self.lora_max_rank is not None and self.lora_max_rank < 1:
            _fail("engine.lora_max_rank", f"must be >= 1 or null, got {self.lora_max_rank}")
        if self.lora_slots < 2:
            _fail("engine.lora_slots", f"must be >= 2 (the base model takes one), got {self.lora_slots}")
        if self.lora_backend not in (None, "torch_native", "triton", "csgmv"):
            _fail("engine.lora_backend", f"must be torch_native, triton, csgmv or null, got {self.lora_backend!r}")
        if self.cpu_mode and self.lora_backend not in (None, "torch_native"):
            _fail("engine.lora_backend", f"={self.lora_backend}: CPU engines have no GPU kernels; use torch_native")
