"""HF checkpoint -> sharded megatron model, and back, in any TP/ETP/EP/PP/DP layout.

Import: every rank maps each of its local params to the global (TP1/EP1/PP1) name, computes which
rows/columns of which HF tensors its shard needs, and reads just those slices from the safetensors.
Export: shards are all-gathered inside their TP (or expert-TP) group; one owner per global param
(TP rank 0 of DP/expert-DP rank 0) converts the full tensor back to HF names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from mrl.megatron.parallel import GroupInfo, Layout
from mrl.models.bridge import ModelBridge, ParamMap, Part, local_spec_name, split_full
from mrl.models.checkpoint import HFCheckpoint
from mrl.log import get_logger

log = get_logger(__name__)

_LAYER = re.compile(r"^(decoder\.layers\.)(\d+)(\..*)$")
_EXPERT = re.compile(r"experts\.local_experts\.(\d+)\.")


@dataclass(frozen=True)
class LocalParam:
    name: str
    param: torch.nn.Parameter
    global_name: str
    is_expert: bool
    shard_group: GroupInfo | None
    """Group the param is split over (TP, or expert-TP for experts); None when replicated."""
    partition_dim: int | None


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):
        model = model.module
    return model


def global_name(model: torch.nn.Module, layout: Layout, name: str) -> tuple[str, bool]:
    """(global TP1/EP1/PP1 local-spec name, is_expert) of this rank's parameter ``name``."""
    m = unwrap(model)
    gname = local_spec_name(name)
    lm = _LAYER.match(gname)
    if lm:  # local layer index -> global (PP stage offset); layer_number is 1-based and global
        gname = f"{lm.group(1)}{m.decoder.layers[int(lm.group(2))].layer_number - 1}{lm.group(3)}"
    em = _EXPERT.search(gname)
    if em:  # local expert index -> global (EP offset)
        num_local_experts = (m.config.num_moe_experts or 0) // layout.ep.size
        global_expert = layout.ep.rank * num_local_experts + int(em.group(1))
        gname = _EXPERT.sub(f"experts.local_experts.{global_expert}.", gname)
    return gname, em is not None


def local_params(model: torch.nn.Module, layout: Layout) -> Iterator[LocalParam]:
    """The model's own weights (LoRA adapters are not: ``mrl.megatron.lora`` exports them)."""
    m = unwrap(model)
    # megatron's router expert bias is a buffer, not a parameter, but it is a checkpoint tensor like
    # any weight (GLM-4.5 / DeepSeek-V3 ``e_score_correction_bias``): loaded, exported and synced
    bias = [(n, b) for n, b in m.named_buffers() if n.endswith(".router.expert_bias")]
    for name, p in [*m.named_parameters(), *bias]:
        if getattr(p, "lora_adapter", False):
            continue
        gname, is_expert = global_name(m, layout, name)
        group = layout.etp if is_expert else layout.tp
        tp_split = getattr(p, "tensor_model_parallel", False) and group.size > 1
        yield LocalParam(name, p, gname, is_expert, group if tp_split else None,
                         p.partition_dim if tp_split else None)


def maps_by_name(bridge: ModelBridge, padded_vocab: int) -> dict[str, ParamMap]:
    maps = {pm.mcore_name: pm for pm in bridge.param_maps(padded_vocab)}
    if bridge.tied_embeddings:
        # tied + PP>1: the last stage holds its own output_layer copy of the embedding
        emb = maps["embedding.word_embeddings.weight"]
        maps["output_layer.weight"] = ParamMap("output_layer.weight", emb.segments, emb.num_cols)
    return maps


def segment_rows(seg: tuple[Part, ...], start: int, stop: int) -> list[tuple[Part, int, int]]:
    """(part, r0, r1) pieces covering rows [start, stop) of the segment, in part coordinates."""
    out, off = [], 0
    for p in seg:
        lo, hi = max(start, off), min(stop, off + p.num_rows)
        if lo < hi:
            out.append((p, p.start + lo - off, p.start + hi - off))
        off += p.num_rows
    return out


def read_shard(ckpt: HFCheckpoint, pm: ParamMap, group: GroupInfo | None, partition_dim: int | None,
               dtype: torch.dtype) -> torch.Tensor:
    """This rank's shard of ``pm``, read slice by slice from the checkpoint."""
    ws, r = (group.size, group.rank) if group is not None else (1, 0)
    if partition_dim == 1:
        (seg,) = pm.segments
        (part,) = seg
        cols = pm.num_cols // ws
        return ckpt.read(part.hf_name, (part.start, part.stop), (r * cols, (r + 1) * cols)).to(dtype)
    pieces = []
    for seg in pm.segments:
        n = sum(p.num_rows for p in seg)
        if n % ws:
            raise ValueError(f"{pm.mcore_name}: {n} rows cannot be split over {ws} ranks")
        lo, hi = (r * n // ws, (r + 1) * n // ws) if partition_dim == 0 else (0, n)
        for part, r0, r1 in segment_rows(seg, lo, hi):
            if part.hf_name is None:
                shape = (r1 - r0,) + ((pm.num_cols,) if pm.num_cols else ())
                pieces.append(torch.zeros(shape, dtype=dtype, device=getattr(ckpt, "device", "cpu")))
            else:
                pieces.append(ckpt.read(part.hf_name, (r0, r1)).to(dtype))
    return torch.cat(pieces, 0)


def load_hf_into(model: torch.nn.Module, layout: Layout, bridge: ModelBridge, ckpt: HFCheckpoint,
                 padded_vocab: int) -> int:
    """Fill every local param of ``model`` from the HF checkpoint (or any reader of its interface:
    ``mrl.models.synthetic.SyntheticWeights``); returns how many were loaded."""
    skipped = bridge.skipped_hf_tensors(ckpt.shapes)
    if skipped:
        log.info("%s: %d tensors are not part of the trained model and are skipped: %s%s", ckpt.path, len(skipped),
                 skipped[:3], " ..." if len(skipped) > 3 else "")
    ckpt.check_against(bridge.hf_tensor_shapes(padded_vocab), skip=skipped)
    maps = maps_by_name(bridge, padded_vocab)
    n = 0
    for lp in local_params(model, layout):
        pm = maps.get(lp.global_name)
        if pm is None:
            raise KeyError(f"megatron param {lp.global_name} ({lp.name}) has no HF mapping in {type(bridge).__name__}")
        t = read_shard(ckpt, pm, lp.shard_group, lp.partition_dim, lp.param.dtype)
        if tuple(t.shape) != tuple(lp.param.shape):
            raise ValueError(f"{lp.global_name}: shard shape {list(t.shape)} != param shape {list(lp.param.shape)}")
        with torch.no_grad():
            lp.param.copy_(t)
        n += 1
    return n


def assemble_full(lp: LocalParam, pm: ParamMap, parts: list[torch.Tensor]) -> torch.Tensor:
    """Full (TP1) tensor from every rank's shard, in group-rank order; segment-aware for SwiGLU fc1."""
    if lp.partition_dim == 1:
        return torch.cat(parts, 1)
    if len(pm.segments) == 1:
        return torch.cat(parts, 0)
    # each rank holds [seg0 chunk; seg1 chunk; ...]: regroup by segment
    n = len(parts)
    sizes = [sum(p.num_rows for p in seg) // n for seg in pm.segments]
    per_rank = [torch.split(t, sizes, 0) for t in parts]
    return torch.cat([per_rank[r][s] for s in range(len(sizes)) for r in range(n)], 0)


def gather_full_many(items: list[tuple[LocalParam, ParamMap]]) -> list[torch.Tensor]:
    """Full (TP1) tensors of many params, all-gathering TP-split ones with one collective per
    (group, dtype): hundreds of TP-split expert tensors cost a handful of collectives. Every member of
    a split group must pass the same params in the same order."""
    out: list[torch.Tensor | None] = [None] * len(items)
    batches: dict[tuple, list[int]] = {}
    for i, (lp, _) in enumerate(items):
        if lp.shard_group is None:
            out[i] = lp.param.detach()
        else:
            batches.setdefault((id(lp.shard_group.group), lp.param.dtype), []).append(i)
    for idx in batches.values():
        g = items[idx[0]][0].shard_group
        shards = [items[i][0].param.detach().contiguous() for i in idx]
        flat = torch.cat([t.view(-1) for t in shards])
        parts = [torch.empty_like(flat) for _ in range(g.size)]
        dist.all_gather(parts, flat, group=g.group)
        numels = [t.numel() for t in shards]
        per_rank = [torch.split(pr, numels) for pr in parts]
        for j, i in enumerate(idx):
            lp, pm = items[i]
            out[i] = assemble_full(lp, pm, [per_rank[r][j].view(shards[j].shape) for r in range(g.size)])
    return out


def is_owner(lp: LocalParam, layout: Layout) -> bool:
    """One copy per global param: TP rank 0 (of its split group) on data-parallel rank 0."""
    if lp.shard_group is not None and lp.shard_group.rank != 0:
        return False
    if lp.is_expert:
        return layout.edp.rank == 0 and (lp.shard_group is not None or layout.etp.rank == 0)
    return layout.dp.rank == 0 and (lp.shard_group is not None or layout.tp.rank == 0)


def export_hf(model: torch.nn.Module, layout: Layout, bridge: ModelBridge, padded_vocab: int,
              dst: int = 0) -> dict[str, torch.Tensor] | None:
    """Full HF-named tensors on global rank ``dst`` (None elsewhere).

    Collects through ``gather_object``: fine for checkpoints that fit one host's memory; the
    streamed, bucketed path for large models is the weight-sync executor.
    """
    maps = maps_by_name(bridge, padded_vocab)
    items = [(lp, maps[lp.global_name]) for lp in local_params(model, layout)
             if not (bridge.tied_embeddings and lp.global_name == "output_layer.weight")]  # embedding copy
    return gather_hf(items, layout, dst)


def gather_hf(items: list[tuple[LocalParam, ParamMap]], layout: Layout, dst: int | None = 0,
              dtype: torch.dtype | None = None) -> dict[str, torch.Tensor] | None:
    """The full HF-named CPU tensors of ``items`` (local params with their maps), each from its one
    owner, on global rank ``dst`` (None elsewhere), or on every rank with ``dst=None``. Collective.
    ``dtype``: cast on the way (e.g. to the engine's dtype)."""
    mine: dict[str, torch.Tensor] = {}
    for (lp, pm), full in zip(items, gather_full_many(items)):
        if is_owner(lp, layout):
            for k, v in split_full(pm, full.detach().cpu()).items():
                mine[k] = v.to(dtype or v.dtype).clone()
    if dst is None:
        objs: list | None = [None] * layout.world_size
        dist.all_gather_object(objs, mine)
    else:
        objs = [None] * layout.world_size if layout.world_rank == dst else None
        dist.gather_object(mine, objs, dst=dst)
        if layout.world_rank != dst:
            return None
    out: dict[str, torch.Tensor] = {}
    for o in objs:
        for k, v in o.items():
            if k in out:
                raise AssertionError(f"{k} exported by two ranks")
            out[k] = v
    return out
