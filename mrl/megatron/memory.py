"""The trainer's model states per GPU, known before a run: weights, main grads and the distributed optimizer's
states on the most loaded rank of a layout, counted from the bridge's parameter maps (no torch, no model).

    est = model_state_bytes(bridge, cfg.parallel, dtype=cfg.model.dtype,
                            optimizer_states_dtype=cfg.train.optimizer_states_dtype,
                            padded_vocab=bridge.padded_vocab(cfg.model.vocab_divisible_by, cfg.parallel.tp))
    est["total_gib"], est["weights_gib"], est["grads_gib"], est["optimizer_gib"]

Model states only, for full fine-tuning (``mrl.megatron.optim``: megatron's DDP with fp32 grad reduction and its
distributed optimizer). Not included: activations, the CUDA caching allocator's slack, NCCL and Transformer
Engine workspaces, non-parameter buffers (rotary tables, router expert biases: kilobytes) and the KL
reference (kept in host memory). docs/memory.md says how to read the figures.

What is exact (tests/unit/test_memory_estimate.py, tests/distributed/test_memory_estimate.py hold it against
the built model): each rank's parameter elements, dense and expert; the DDP buffers (param and grad) with
megatron's padding; the optimizer's elements where a buffer's data-parallel group has one rank. With more
ranks the optimizer keeps state for the part of the padded buffer its shard covers: the estimate takes a
whole shard, more than the true count by at most the buffer's padding.
"""

from __future__ import annotations

import math
import re

from mrl.config.schema import DType, ParallelConfig
from mrl.models.bridge import ModelBridge, ParamMap

GIB = 1 << 30
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.local_experts\.(\d+)\.")

# Parameters megatron splits over TP (ETP for routed experts), by the end of their local-spec name: column-
# parallel linears and the vocab-parallel embedding and head split rows, row-parallel linears columns; either
# way a rank holds 1/tp of the elements. Everything else (norms, the router, q/k norms, and MLA's down
# projections under Transformer Engine, which builds them 'duplicated') is whole on every TP rank.
_TP_SPLIT = ("embedding.word_embeddings.weight", "output_layer.weight", ".linear_qkv.weight", ".linear_qkv.bias",
             ".linear_fc1.weight", ".linear_fc2.weight", ".linear_proj.weight", ".linear_q_proj.weight",
             ".linear_q_up_proj.weight", ".linear_kv_up_proj.weight")
# megatron's local spec (no Transformer Engine: CPU runs) builds MLA's down projections column-parallel
_LOCAL_SPEC_TP_SPLIT = (".linear_q_down_proj.weight", ".linear_kv_down_proj.weight")
_BUFFERS = (".router.expert_bias",)
"""Checkpoint tensors the bridges map that are buffers in megatron: no grad, no optimizer state."""


def is_tp_split(mcore_name: str, *, local_spec: bool = False) -> bool:
    """Whether megatron splits this global parameter over TP (over ETP for routed experts)."""
    return mcore_name.endswith(_TP_SPLIT + (_LOCAL_SPEC_TP_SPLIT if local_spec else ()))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def stage_of(mcore_name: str, stage_layers: list[int]) -> int:
    """PP stage holding a global parameter: a layer's by its index; the embedding on the first stage; the
    final norm and the output layer on the last."""
    m = _LAYER.match(mcore_name)
    if m:
        layer, end = int(m.group(1)), 0
        for stage, n in enumerate(stage_layers):
            end += n
            if layer < end:
                return stage
        raise ValueError(f"{mcore_name}: layer beyond the model's {end} layers")
    return 0 if mcore_name.startswith("embedding.") else len(stage_layers) - 1


def stage_maps(bridge: ModelBridge, padded_vocab: int, stage_layers: list[int], stage: int) -> list[ParamMap]:
    """The trainable global parameters of one PP stage. Tied embeddings under PP: the last stage keeps its
    own copy of the embedding as ``output_layer.weight`` (as ``mrl.megatron.weights.maps_by_name`` maps it)."""
    maps = [pm for pm in bridge.param_maps(padded_vocab) if not pm.mcore_name.endswith(_BUFFERS)]
    out = [pm for pm in maps if stage_of(pm.mcore_name, stage_layers) == stage]
    if bridge.tied_embeddings and len(stage_layers) > 1 and stage == len(stage_layers) - 1:
        emb = next(pm for pm in maps if pm.mcore_name == "embedding.word_embeddings.weight")
        out.append(ParamMap("output_layer.weight", emb.segments, emb.num_cols))
    return out


def local_numels(bridge: ModelBridge, parallel: ParallelConfig, padded_vocab: int, stage: int, *,
                 local_spec: bool = False) -> tuple[dict[str, int], dict[str, int]]:
    """({global name: local elements}) of the dense and the routed-expert parameters one rank of PP stage
    ``stage`` holds. Every TP and EP rank of a stage holds as many (megatron splits evenly), so this counts
    EP rank 0's experts."""
    per_rank = bridge.num_experts // parallel.ep if bridge.num_experts else 0
    dense: dict[str, int] = {}
    expert: dict[str, int] = {}
    for pm in stage_maps(bridge, padded_vocab, parallel.stage_layers(bridge.num_layers), stage):
        n = math.prod(pm.shape)
        split = is_tp_split(pm.mcore_name, local_spec=local_spec)
        if e := _EXPERT.search(pm.mcore_name):
            if int(e.group(1)) < per_rank:
                expert[pm.mcore_name] = n // parallel.expert_tp if split else n
        else:
            dense[pm.mcore_name] = n // parallel.tp if split else n
    return dense, expert


def ddp_buffer_numel(numels: list[int], dp: int, own_bucket: list[int] | None = None) -> int:
    """Elements of megatron's DDP buffer (params and grads alike) for params of ``numels``, sharded over ``dp``
    ranks: mrl's DDP does not overlap the grad reduce, so a buffer is one bucket (``own_bucket``: params that
    take a bucket of their own, the tied embedding under PP). Each param starts at a multiple of 64 elements
    and a bucket ends at a multiple of lcm(dp, 128) (``optimizer/param_layout.py``); 64 divides that
    multiple, so the padded end is the same whatever the parameters' order."""
    end = math.lcm(dp, 128)
    buckets = [b for b in [numels, *([n] for n in own_bucket or [])] if b]
    return sum(_round_up(sum(_round_up(n, 64) for n in b), end) for b in buckets)


def optimizer_bytes_per_element(dtype: DType, states: DType) -> int:
    """Bytes the distributed optimizer keeps per parameter element of its shard.

    fp32 states: Adam's two fp32 moments, plus an fp32 master copy for bf16 params (fp32 params are their
    own master: the shard is a view of the param). bf16 states: megatron's precision-aware optimizer hands
    the shards to Transformer Engine's FusedAdam (``master_weights=True``, ``store_param_remainders=True``):
    bf16 moments, and as master weights the 16 low bits of each fp32 master (int16) for bf16 params, a full
    fp32 copy for fp32 params. Transformer Engine before 2.1 stores the full fp32 master (megatron turns the
    remainders off): 2 bytes more for bf16 params."""
    if states == DType.fp32:
        return 8 + (4 if dtype == DType.bf16 else 0)
    return 4 + (2 if dtype == DType.bf16 else 4)


def stage_model_states(bridge: ModelBridge, parallel: ParallelConfig, *, stage: int, world_size: int, dtype: DType,
                       optimizer_states_dtype: DType, padded_vocab: int, local_spec: bool = False) -> dict:
    """``model_state_bytes``' figures (without the GiB) for a rank of PP stage ``stage``."""
    dense, expert = local_numels(bridge, parallel, padded_vocab, stage, local_spec=local_spec)
    dp = world_size // (parallel.tp * parallel.pp)  # megatron shards dense params over DP x CP
    edp = world_size // (parallel.ep * parallel.expert_tp * parallel.pp)
    last = stage == parallel.pp - 1
    own = "embedding.word_embeddings.weight" if stage == 0 else ("output_layer.weight" if last else "")
    own = own if bridge.tied_embeddings and parallel.pp > 1 else ""
    dense_numels = [n for k, n in dense.items() if k != own]
    own_bucket = [dense[own]] if own in dense else []
    # experts have a buffer of their own (expert-DP) when EP > 1 or ETP != TP; otherwise they share the dense one
    separate = parallel.ep > 1 or parallel.expert_tp != parallel.tp
    if not separate:
        dense_numels += list(expert.values())
    buf_dense = ddp_buffer_numel(dense_numels, dp, own_bucket)
    buf_expert = ddp_buffer_numel(list(expert.values()), edp) if separate else 0
    n_dense, n_expert = sum(dense.values()), sum(expert.values())
    # the optimizer's elements: its shard of each buffer, never more than the params the buffer holds
    opt_dense = min(n_dense + (0 if separate else n_expert), buf_dense // dp)
    opt_expert = min(n_expert, buf_expert // edp) if separate else 0
    weight_bytes = 2 if dtype == DType.bf16 else 4
    out = dict(pp_stage=stage, dp=dp, edp=edp, dense_params=n_dense, expert_params=n_expert,
               dense_buffer=buf_dense, expert_buffer=buf_expert, dense_optimizer=opt_dense,
               expert_optimizer=opt_expert,
               weights_bytes=(buf_dense + buf_expert) * weight_bytes,
               grads_bytes=(buf_dense + buf_expert) * 4,  # grad_reduce_in_fp32
               optimizer_bytes=(opt_dense + opt_expert) * optimizer_bytes_per_element(dtype, optimizer_states_dtype))
    out["total_bytes"] = out["weights_bytes"] + out["grads_bytes"] + out["optimizer_bytes"]
    return out


def model_state_bytes(bridge: ModelBridge, parallel: ParallelConfig, *, dtype: DType, optimizer_states_dtype: DType,
                      padded_vocab: int, world_size: int | None = None, local_spec: bool = False) -> dict:
    """Model states of the most loaded trainer rank of ``parallel`` over ``world_size`` ranks (default: the
    layout's own, ``parallel.local_world_size``), for a model of ``dtype`` trained with Adam states of
    ``optimizer_states_dtype``. ``local_spec``: megatron's local spec (no Transformer Engine) instead of TE's.

    Returns the PP stage of that rank, its parameter elements (``dense_params``, ``expert_params``: routed
    experts), its DDP buffer elements (``dense_buffer``, ``expert_buffer``; 0 where the experts share the
    dense buffer), the elements its optimizer keeps state for (``dense_optimizer``, ``expert_optimizer``), and
    ``weights``, ``grads``, ``optimizer`` and ``total`` as ``*_bytes`` and ``*_gib``. Model states only: no
    activations, no allocator slack."""
    world = world_size or parallel.local_world_size
    parallel.check_world_size(world)
    parallel.check_model(num_experts=bridge.num_experts, num_layers=bridge.num_layers,
                         num_query_groups=bridge.num_query_groups)
    stages = [stage_model_states(bridge, parallel, stage=s, world_size=world, dtype=dtype,
                                 optimizer_states_dtype=optimizer_states_dtype, padded_vocab=padded_vocab,
                                 local_spec=local_spec) for s in range(parallel.pp)]
    out = max(stages, key=lambda s: s["total_bytes"])
    out.update({f"{k}_gib": out[f"{k}_bytes"] / GIB for k in ("weights", "grads", "optimizer", "total")})
    out.update(world_size=world, dtype=dtype.value, optimizer_states_dtype=optimizer_states_dtype.value)
    return out


def lora_numels(bridge: ModelBridge, lora, parallel: ParallelConfig,
                stage: int) -> tuple[dict[str, int], dict[str, int]]:
    """({name: local elements}) of the dense and the routed-expert LoRA factors one rank of PP stage ``stage``
    holds (``mrl.megatron.lora``'s sharding): a column site's ``A`` (every HF module's ``[r, in]``) whole and
    its ``B`` split by rows over TP (ETP for experts), a row site's ``A`` split by columns and its ``B`` whole."""
    from mrl.models.peft import lora_sites

    per_rank = bridge.num_experts // parallel.ep if bridge.num_experts else 0
    stages = parallel.stage_layers(bridge.num_layers)
    dense: dict[str, int] = {}
    expert: dict[str, int] = {}
    for site in lora_sites(bridge, lora):
        if stage_of(site.mcore_name, stages) != stage:
            continue
        e = _EXPERT.search(site.mcore_name)
        if e and int(e.group(1)) >= per_rank:
            continue
        ws = parallel.expert_tp if site.is_expert else parallel.tp
        r, cols, rows = site.rank, site.in_features, site.weight.shape[0]
        a = len(site.hf_modules) * r * cols if site.kind == "column" else r * cols // ws
        b = rows // ws * r if site.kind == "column" else rows * r
        into = expert if site.is_expert else dense
        into[f"{site.mcore_name}.lora_A"], into[f"{site.mcore_name}.lora_B"] = a, b
    return dense, expert


def lora_state_bytes(bridge: ModelBridge, parallel: ParallelConfig, lora, *, dtype: DType,
                     optimizer_states_dtype: DType, padded_vocab: int, world_size: int | None = None,
                     local_spec: bool = False) -> dict:
    """A LoRA run's model states on its most loaded rank: the frozen base weights (no grads, no optimizer
    states: megatron's DDP and the optimizer hold the adapters only, ``mrl.megatron.lora``) and the adapters
    with their fp32 grads and Adam states. ``lora``: ``cfg.model.lora``.

    Returns ``base_params``, ``adapter_params`` (elements), ``adapter_buffer`` (the DDP buffers' elements,
    padded), ``adapter_optimizer``, and ``base``, ``adapters``, ``grads``, ``optimizer``, ``total`` as
    ``*_bytes`` and ``*_gib``. The base is held outside the DDP buffers (frozen parameters are not put in
    them), so it has no padding."""
    world = world_size or parallel.local_world_size
    parallel.check_world_size(world)
    parallel.check_model(num_experts=bridge.num_experts, num_layers=bridge.num_layers,
                         num_query_groups=bridge.num_query_groups)
    weight_bytes = 2 if dtype == DType.bf16 else 4
    dp = world // (parallel.tp * parallel.pp)
    edp = world // (parallel.ep * parallel.expert_tp * parallel.pp)
    separate = parallel.ep > 1 or parallel.expert_tp != parallel.tp
    per_elem = optimizer_bytes_per_element(dtype, optimizer_states_dtype)
    best = None
    for stage in range(parallel.pp):
        base_dense, base_expert = local_numels(bridge, parallel, padded_vocab, stage, local_spec=local_spec)
        dense, expert = lora_numels(bridge, lora, parallel, stage)
        n_dense, n_expert = sum(dense.values()), sum(expert.values())
        buf_dense = ddp_buffer_numel(list(dense.values()) + ([] if separate else list(expert.values())), dp)
        buf_expert = ddp_buffer_numel(list(expert.values()), edp) if separate else 0
        opt = min(n_dense + (0 if separate else n_expert), buf_dense // dp) + \
            (min(n_expert, buf_expert // edp) if separate else 0)
        base = sum(base_dense.values()) + sum(base_expert.values())
        out = dict(pp_stage=stage, dp=dp, edp=edp, base_params=base, adapter_params=n_dense + n_expert,
                   adapter_buffer=buf_dense + buf_expert, adapter_optimizer=opt,
                   base_bytes=base * weight_bytes, adapters_bytes=(buf_dense + buf_expert) * weight_bytes,
                   grads_bytes=(buf_dense + buf_expert) * 4, optimizer_bytes=opt * per_elem)
        out["total_bytes"] = sum(out[f"{k}_bytes"] for k in ("base", "adapters", "grads", "optimizer"))
        if best is None or out["total_bytes"] > best["total_bytes"]:
            best = out
    best.update({f"{k}_gib": best[f"{k}_bytes"] / GIB for k in ("base", "adapters", "grads", "optimizer", "total")})
    best.update(world_size=world, dtype=dtype.value, optimizer_states_dtype=optimizer_states_dtype.value,
                lora_rank=lora.rank, lora_targets=list(lora.targets))
    return best


def _size(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / (1 << 20):.1f} MiB"


def describe(est: dict, parallel: ParallelConfig) -> str:
    """One line for ``mrl check``: the figures of ``model_state_bytes`` and what they leave out."""
    ranks = est["world_size"]
    return (f"model states per trainer rank: {_size(est['total_bytes'])} = weights {_size(est['weights_bytes'])} + "
            f"grads {_size(est['grads_bytes'])} + optimizer {_size(est['optimizer_bytes'])} ({est['dtype']} weights, "
            f"fp32 grads, {est['optimizer_states_dtype']} Adam states; tp{parallel.tp} pp{parallel.pp} "
            f"ep{parallel.ep} etp{parallel.expert_tp} on {ranks} rank{'s' if ranks > 1 else ''}: dp{est['dp']} "
            f"edp{est['edp']}); activations and allocator slack not included (docs/memory.md)")


def checkpoint_bytes(bridge: ModelBridge, *, dtype: DType, optimizer_states_dtype: DType, padded_vocab: int,
                     optimizer_checkpoint: str) -> tuple[int, int]:
    """(parameters, a lower bound on one trainer checkpoint's bytes on disk): every parameter once in the
    model's dtype and the optimizer's state once, as the ranks hold it (``dp_reshardable``) or as megatron's
    fully reshardable format writes it (fp32 master weights and both moments). Padding, metadata and the
    RNG and loop files are left out, and so is a master copy the optimizer does not keep apart (fp32 models)."""
    est = stage_model_states(bridge, ParallelConfig(), stage=0, world_size=1, dtype=dtype,
                             optimizer_states_dtype=optimizer_states_dtype, padded_vocab=padded_vocab)
    n = est["dense_params"] + est["expert_params"]
    per = 12 if optimizer_checkpoint == "fully_reshardable" else optimizer_bytes_per_element(dtype,
                                                                                           optimizer_states_dtype)
    return n, n * ((2 if dtype == DType.bf16 else 4) + per)
