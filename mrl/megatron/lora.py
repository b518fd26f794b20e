"""LoRA adapters on megatron-core's parallel linears: applied after the HF load and before DDP.

    adapters = apply_lora(model, layout, bridge, cfg.model.lora, seed=cfg.model.seed)  # base weights frozen
    ddp = wrap_ddp(model, tcfg)          # DDP buckets and the optimizer see requires_grad params: the adapters
    tensors, config = export_peft(model, layout, bridge, cfg.model.lora)   # rank 0: full HF PEFT tensors

An adapter is a module beside the linear it adapts (``linear_qkv_lora`` next to ``linear_qkv``) whose delta
``(alpha / r) * B @ A @ x`` a forward hook adds to the linear's output. The base modules keep their class,
their parameter names and their checkpoint code, so the HF loader/exporter and the full-weight sync see the
same model as without LoRA (they skip parameters tagged ``lora_adapter``).

Sharding: each factor follows its base weight, and the adapter's collectives mirror the base's own.
- column-parallel (``linear_qkv``, ``linear_fc1``): ``A`` ``[n*r, in]`` replicated (one ``[r, in]`` per HF
  module: q, k, v or gate, up), ``B`` ``[out/tp, r]`` split exactly as the weight's rows (``mrl.models.peft``);
- row-parallel (``linear_proj``, ``linear_fc2``): ``A`` ``[r, in/tp]`` split as the weight's columns, ``B``
  ``[out, r]`` replicated.
The intermediate ``h = A x`` is r wide, so the adapter communicates r-wide tensors, never hidden-size ones:
- no sequence parallelism: column ``h`` goes through ``copy_to`` (its grad is summed over TP, each rank held
  part of B's rows); row ``h`` through ``reduce_from`` (each rank held part of A's columns);
- sequence parallelism: column ``h`` is all-gathered over the sequence (grad reduce-scattered) and row ``h``
  reduce-scattered, where the base gathers/scatters the hidden states; the replicated factor saw only this
  rank's tokens, so its grad is summed over TP (``copy_to`` on the factor);
- experts with explicit communication (EP > 1 or ETP > 1): no collective on the activations (the token
  dispatcher gathers and reduces, for the base and the adapter alike); the replicated factor's grad is summed
  over expert-TP, where each rank saw part of the rows (column) or a partial sum (row).
Expert adapters are tagged ``allreduce=False``: DDP reduces them over expert-DP like the experts.
"""

from __future__ import annotations

import zlib
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mrl._compat.te import te_linear_kinds
from mrl.config.schema import LoraConfig
from mrl.megatron.parallel import GroupInfo, Layout
from mrl.megatron.weights import LocalParam, gather_hf, global_name, segment_rows, unwrap, \
    read_shard
from mrl.models.bridge import ModelBridge, ParamMap
from mrl.models.peft import LoraSite, check_peft, load_peft, lora_sites, peft_config, peft_shapes
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    gather_from_sequence_parallel_region,
                                                    reduce_from_tensor_model_parallel_region,
                                                    reduce_scatter_to_sequence_parallel_region)

SUFFIX = "_lora"
"""An adapter is registered beside its linear as ``<linear name>_lora``; checkpoint keys of adapters hold it."""


def _kind(module: torch.nn.Module) -> str | None:
    if isinstance(module, ColumnParallelLinear):
        return "column"
    if isinstance(module, RowParallelLinear):
        return "row"
    return te_linear_kinds().get(type(module))


class _Norm:
    """The input norm of a Transformer Engine linear that fuses it (``TELayerNormColumnParallelLinear``),
    recomputed for the adapter: the forward hook sees the linear's input, before the norm."""

    def __init__(self, base: torch.nn.Module):
        self.base = base

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        cfg, b = self.base.config, self.base
        w = b.layer_norm_weight.float() + (1.0 if cfg.layernorm_zero_centered_gamma else 0.0)
        xf = x.float()
        if cfg.normalization == "RMSNorm":
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + cfg.layernorm_epsilon) * w
        else:
            bias = getattr(b, "layer_norm_bias", None)
            y = F.layer_norm(xf, (x.shape[-1],), w, None if bias is None else bias.float(), cfg.layernorm_epsilon)
        return y.to(x.dtype)


class LoraAdapter(torch.nn.Module):
    """The two factors of one linear (one local expert for grouped experts) and its delta."""

    def __init__(self, site: LoraSite, *, scale: float, group: GroupInfo, explicit_comm: bool, sequence_parallel: bool,
                 dtype: torch.dtype, device: torch.device, seed: int):
        super().__init__()
        self.site, self.scale, self.group = site, scale, group
        self.explicit, self.sp = explicit_comm, sequence_parallel
        r, ws, rk = site.rank, group.size, group.rank
        mods = site.hf_modules
        full_a = [_kaiming_uniform(seed, h, r, site.in_features) for h in mods]
        if site.kind == "column":
            a = torch.cat(full_a, 0)
            # which HF module each local row of the weight (and of B) belongs to, in the weight's local order
            row_mod: list[int] = []
            for seg in site.weight.segments:
                n = sum(p.num_rows for p in seg)
                for part, r0, r1 in segment_rows(seg, rk * n // ws, (rk + 1) * n // ws):
                    row_mod += [mods.index(part.hf_name)] * (r1 - r0)
            b = torch.zeros(len(row_mod), r)
            self._plan_rows(row_mod, len(mods), device)
        else:
            (a,) = full_a
            cols = site.in_features // ws
            a = a[:, rk * cols:(rk + 1) * cols]
            b = torch.zeros(site.weight.shape[0], r)
        self.A = torch.nn.Parameter(a.to(device=device, dtype=dtype).contiguous())
        self.B = torch.nn.Parameter(b.to(device=device, dtype=dtype))
        set_tensor_model_parallel_attributes(self.A, site.kind == "row", 1, 1)
        set_tensor_model_parallel_attributes(self.B, site.kind == "column", 0, 1)
        for p in (self.A, self.B):
            p.lora_adapter = True
            if site.is_expert:
                p.allreduce = False  # reduced over expert-DP, like the experts' weights

    def _plan_rows(self, row_mod: list[int], n_mod: int, device) -> None:
        """How ``cat_j(h_j @ B_j^T)`` (module-major) maps onto the weight's local rows: contiguous slices when
        each module's rows are one block in module order (``linear_fc1``: [gate; up]), else an index per
        module and a permutation (``linear_qkv``: q/k/v interleaved by KV group)."""
        self.n_mod = n_mod
        rows = [[i for i, m in enumerate(row_mod) if m == j] for j in range(n_mod)]
        order = [i for rs in rows for i in rs]
        if order == list(range(len(row_mod))):
            self._slices = [(rs[0], len(rs)) for rs in rows]
            self._index = self._perm = None
        else:
            self._slices = None
            self._index = [torch.tensor(rs, dtype=torch.long, device=device) for rs in rows]
            self._perm = torch.argsort(torch.tensor(order, dtype=torch.long)).to(device)

    # -- forward -------------------------------------------------------------------------------------
    def attach(self, base: torch.nn.Module, norm: _Norm | None = None) -> None:
        """Add this adapter's delta to ``base``'s output from now on (``norm``: recompute its fused input norm)."""
        self._norm = norm
        self._handle = base.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        out, bias = output  # megatron's linears return (output, bias or None)
        x = args[0] if self._norm is None else self._norm(args[0])
        return out + self.delta(x).to(out.dtype), bias

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        return self._column(x) if self.site.kind == "column" else self._row(x)

    def _column(self, x: torch.Tensor) -> torch.Tensor:
        g, split = self.group.group, self.group.size > 1
        a = self.A
        if split and (self.sp or self.explicit):
            a = copy_to_tensor_model_parallel_region(a, group=g)  # each rank's dA covers part of the result
        h = F.linear(x, a)
        if split and self.sp:
            h = gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True, group=g)
        elif split and not self.explicit:
            h = copy_to_tensor_model_parallel_region(h, group=g)  # dh: each rank holds part of B's rows
        h = h * self.scale
        if self.n_mod == 1:
            return F.linear(h, self.B)
        hs = h.chunk(self.n_mod, -1)
        if self._slices is not None:
            return torch.cat([F.linear(hj, self.B.narrow(0, lo, n)) for hj, (lo, n) in zip(hs, self._slices)], -1)
        out = torch.cat([F.linear(hj, self.B.index_select(0, idx)) for hj, idx in zip(hs, self._index)], -1)
        return out.index_select(-1, self._perm)

    def _row(self, x: torch.Tensor) -> torch.Tensor:
        g, split = self.group.group, self.group.size > 1
        b = self.B
        if split and (self.sp or self.explicit):
            b = copy_to_tensor_model_parallel_region(b, group=g)  # each rank's dB covers part of the result
        h = F.linear(x, self.A)
        if split and not self.explicit:
            h = (reduce_scatter_to_sequence_parallel_region(h, group=g) if self.sp
                 else reduce_from_tensor_model_parallel_region(h, group=g))
        return F.linear(h * self.scale, b)

    # -- checkpoint ----------------------------------------------------------------------------------
    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None, **_):
        """As megatron shards the base weight: B of a column linear along dim 0 (SwiGLU fc1: its gate and up
        halves separately, so a checkpoint reloads in another TP), A of a row linear along dim 1."""
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        axis = {"B": 0} if self.site.kind == "column" else {"A": 1}
        sd = make_sharded_tensors_for_checkpoint({"A": self.A, "B": self.B}, prefix, axis, sharded_offsets,
                                                 tp_group=self.group.group, dp_cp_group=metadata["dp_cp_group"])
        if self.site.kind == "column" and len(self.site.weight.segments) == 2:
            sd[f"{prefix}B"] = apply_swiglu_sharded_factory(
                sd[f"{prefix}B"], sharded_offsets, metadata.get("singleton_local_shards", False),
                tp_group=self.group.group, dp_group=metadata["dp_cp_group"])
        return sd


def _kaiming_uniform(seed: int, hf_module: str, rows: int, cols: int) -> torch.Tensor:
    """PEFT's ``lora_A`` init (kaiming-uniform, a=sqrt(5): U(-1/sqrt(in), 1/sqrt(in))), drawn from a generator
    seeded by the module's HF name: every layout starts from the same adapter."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{hf_module}".encode()))
    bound = 1.0 / cols ** 0.5
    return torch.empty(rows, cols).uniform_(-bound, bound, generator=g)


class GroupedLora(torch.nn.Module):
    """The adapters of Transformer Engine's grouped experts (one ``GroupedLinear`` for every local expert): the
    hook splits the permuted tokens by expert (``m_splits``) as the grouped GEMM does."""

    def __init__(self, adapters: list[LoraAdapter], global_experts: list[int], num_experts: int, edp_rank: int):
        super().__init__()
        self.experts = torch.nn.ModuleList(adapters)
        self.global_experts, self.num_experts, self.edp_rank = global_experts, num_experts, edp_rank

    def attach(self, base: torch.nn.Module, norm: None = None) -> None:
        self._handle = base.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        (x, m_splits), (out, bias) = args[:2], output
        xs = torch.split(x, [int(m) for m in m_splits])
        return out + torch.cat([e.delta(xi) for e, xi in zip(self.experts, xs)], 0).to(out.dtype), bias

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None, **_):
        """Keys as SequentialMLP's experts would have them (one expert axis), so checkpoints of both load."""
        from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding

        out = {}
        for i, (e, g) in enumerate(zip(self.experts, self.global_experts)):
            offsets = (*sharded_offsets, (len(sharded_offsets), g, self.num_experts))
            sd = e.sharded_state_dict(f"{prefix}experts.{i}.", offsets, metadata)
            replace_prefix_for_sharding(sd, f"{prefix}experts.{i}.", prefix)
            for t in sd.values():
                t.replica_id = (*t.replica_id[:2], self.edp_rank)
            out.update(sd)
        return out


# -- applying ----------------------------------------------------------------------------------------------
def apply_lora(model: torch.nn.Module, layout: Layout, bridge: ModelBridge, lora: LoraConfig, *,
               seed: int) -> list[torch.nn.Module]:
    """Freeze every parameter of ``model`` and add an adapter to each linear of ``lora.targets``, B = 0 (the
    model's outputs are unchanged). Collective (checks that every site of the model got its adapter). Run it
    after the HF load and before ``wrap_ddp``."""
    if not lora.enabled:
        raise ValueError("model.lora.rank is 0: LoRA is off")
    m = unwrap(model)
    sites = {s.mcore_name: s for s in lora_sites(bridge, lora)}
    for p in m.parameters():
        p.requires_grad_(False)
    cfg = m.config
    ep = cfg.expert_model_parallel_size
    made: list[torch.nn.Module] = []
    wrapped: list[str] = []
    for name, base in list(m.named_modules()):
        kind = _kind(base)
        if kind is None:
            continue
        grouped = kind.startswith("grouped_")
        weights = [f"{name}.weight{e}" for e in range(base.num_gemms)] if grouped else [f"{name}.weight"]
        found = [(w, *global_name(m, layout, w)) for w in weights]
        mine = [(w, g, is_exp) for w, g, is_exp in found if g in sites]
        if not mine:
            continue
        if grouped and getattr(_parent(m, name), "_with_fused_impl", False):
            raise ValueError("model.lora.targets=experts: Transformer Engine's fused grouped MLP "
                             "(NVTE_CUTEDSL_FUSED_GROUPED_MLP) never calls its linears, so adapters cannot hook them; "
                             "unset NVTE_CUTEDSL_FUSED_GROUPED_MLP")
        adapters = []
        for w, g, is_exp in mine:
            site = sites[g]
            group = layout.etp if is_exp else layout.tp
            explicit = is_exp and (group.size > 1 or ep > 1)
            weight = base.get_parameter(w.rsplit(".", 1)[1])
            sp = bool(cfg.sequence_parallel) and group.size > 1 and not explicit
            adapters.append(LoraAdapter(site, scale=lora.scale, group=group, explicit_comm=explicit,
                                        sequence_parallel=sp, dtype=weight.dtype, device=weight.device, seed=seed))
            wrapped.append(g)
        if grouped:
            experts = [int(g.split(".local_experts.")[1].split(".")[0]) for _, g, _ in mine]
            hooked: torch.nn.Module = GroupedLora(adapters, experts, cfg.num_moe_experts, layout.edp.rank)
        else:
            (hooked,) = adapters
        _parent(m, name).add_module(name.rpartition(".")[2] + SUFFIX, hooked)
        hooked.attach(base, _Norm(base) if kind == "column_norm" else None)
        made.append(hooked)
    _check_every_site(set(sites), wrapped, bridge)
    if cfg.recompute_granularity is not None and getattr(m, "embedding", None) is not None:
        m.embedding.register_forward_hook(_output_requires_grad)
    return made


def _output_requires_grad(_module, _inputs, out: torch.Tensor) -> torch.Tensor:
    """Megatron's activation recompute is a reentrant autograd function over each layer's input: its backward,
    where the layer runs again and the adapters get their grads, runs only if that input requires grad. With
    the base frozen the embedding's output does not, and every adapter would train on zero grads; the first
    stage's hidden states are made to (PP's later stages receive them so already)."""
    return out if out.requires_grad else out.requires_grad_(True)


def _parent(m: torch.nn.Module, name: str) -> torch.nn.Module:
    parent_name = name.rpartition(".")[0]
    return m.get_submodule(parent_name) if parent_name else m


def _check_every_site(sites: set[str], wrapped: list[str], bridge: ModelBridge) -> None:
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, wrapped)
    missing = sorted(sites - {g for w in everyone for g in w})
    if missing:
        more = " ..." if len(missing) > 4 else ""
        raise ValueError(f"model.lora.targets: {len(missing)} linears of {bridge.path or type(bridge).__name__} got "
                         f"no adapter (not a linear class LoRA wraps): {missing[:4]}{more}")


def adapters(model: torch.nn.Module) -> Iterator[LoraAdapter]:
    """Every adapter of this rank, in module order (the same on every rank of a TP/ETP group)."""
    for mod in unwrap(model).modules():
        if isinstance(mod, LoraAdapter):
            yield mod


def is_adapter_key(key: str) -> bool:
    """Whether a (sharded) state-dict key belongs to an adapter."""
    return f"{SUFFIX}." in key


# -- PEFT export / import ----------------------------------------------------------------------------------
def _factors(ad: LoraAdapter) -> list[tuple[torch.nn.Parameter, ParamMap, int | None]]:
    """(param, its map in PEFT names, split dim or None) of an adapter's two factors."""
    split = ad.group.size > 1
    col = ad.site.kind == "column"
    return [(ad.A, ad.site.a_map, 1 if split and not col else None),
            (ad.B, ad.site.b_map, 0 if split and col else None)]


def _local_items(model: torch.nn.Module, layout: Layout) -> list[tuple[LocalParam, ParamMap]]:
    items = []
    for ad in adapters(model):
        for p, pm, dim in _factors(ad):
            items.append((LocalParam(pm.mcore_name, p, pm.mcore_name, ad.site.is_expert,
                                     ad.group if dim is not None else None, dim), pm))
    return items


def export_peft(model: torch.nn.Module, layout: Layout, bridge: ModelBridge, lora: LoraConfig, *, dst: int | None = 0,
                dtype: torch.dtype | None = None) -> tuple[dict[str, torch.Tensor], dict] | None:
    """The adapter as HF PEFT: (full, unsharded CPU tensors by PEFT name, ``adapter_config.json`` dict), on global
    rank ``dst`` (None elsewhere), or on every rank with ``dst=None``. Collective. ``dtype``: cast the tensors
    (the engine's dtype); default the trainer's."""
    out = gather_hf(_local_items(model, layout), layout, dst, dtype)
    if out is None:
        return None
    check_peft(out, peft_config(lora), peft_shapes(bridge, lora), lora, where="export")
    return out, peft_config(lora, base_model=bridge.path)


class _TensorReader:
    """``HFCheckpoint.read`` over a dict of full tensors (for ``read_shard``)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def read(self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None):
        t = self.tensors[name]
        t = t[rows[0]:rows[1]] if rows is not None else t
        return t[:, cols[0]:cols[1]] if cols is not None else t


def load_peft_into(model: torch.nn.Module, layout: Layout, bridge: ModelBridge, lora: LoraConfig,
                   tensors: dict[str, torch.Tensor], config: dict, *, where: str = "adapter") -> None:
    """Copy a full PEFT adapter (every rank passes the same tensors) into this rank's adapter shards."""
    check_peft(tensors, config, peft_shapes(bridge, lora), lora, where=where)
    reader = _TensorReader(tensors)
    with torch.no_grad():
        for ad in adapters(model):
            for p, pm, dim in _factors(ad):
                p.copy_(read_shard(reader, pm, ad.group if dim is not None else None, dim, p.dtype))


def load_peft_dir_into(model: torch.nn.Module, layout: Layout, bridge: ModelBridge, lora: LoraConfig,
                       path: str) -> None:
    """``load_peft_into`` from an HF PEFT directory (``model.lora.init_from``)."""
    tensors, config = load_peft(path)
    load_peft_into(model, layout, bridge, lora, tensors, config, where=f"model.lora.init_from={path}")
