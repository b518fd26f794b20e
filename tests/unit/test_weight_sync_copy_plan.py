"""The static copy plan on one rank (TP1: no gathers, no process group): its flat buffers hold exactly
the bytes of the per-tensor path (``split_full`` per param, cast, concatenated), for q/k/v interleaved
per KV group, padded vocab rows, [gate; up] concatenations and 1-D norms, with and without a cast;
row-identity params are one copy each. Multi-rank layouts: tests/distributed/test_weight_sync_copy_plan.py."""

from __future__ import annotations

import pytest
import torch

from mrl.megatron.weights import LocalParam
from mrl.models import get_bridge
from mrl.models.bridge import split_full
from mrl.weight_sync.copy_plan import build_steps, hf_runs
from mrl.weight_sync.planner import TrainerLayout, plan_sync


def _plan(bridge, vp: int, bucket_bytes: int, dtype: str):
    return plan_sync(bridge.param_maps(vp), TrainerLayout(tp=1, pp=1, ep=1, etp=1, world_size=1),
                     num_layers=bridge.num_layers, num_experts=bridge.num_experts, bucket_bytes=bucket_bytes,
                     dtype=dtype, tied=bridge.tied_embeddings)


@pytest.mark.parametrize("preset", ["stress_a", "stress_b"])
@pytest.mark.parametrize("param_dtype,sync_dtype", [(torch.float32, "float32"), (torch.float32, "bfloat16"),
                                                    (torch.bfloat16, "bfloat16")])
def test_tp1_copy_plan_bytes_equal_the_per_tensor_path(ckpt_dir, preset, param_dtype, sync_dtype):
    bridge = get_bridge(ckpt_dir[preset])
    vp = bridge.padded_vocab(128, 1)
    maps = {pm.mcore_name: pm for pm in bridge.param_maps(vp)}
    g = torch.Generator().manual_seed(0)
    local = {n: LocalParam(n, torch.nn.Parameter(torch.randn(pm.shape, generator=g).to(param_dtype),
                                                 requires_grad=False), n, ".experts." in n, None, None)
             for n, pm in maps.items()}
    plan = _plan(bridge, vp, 24 << 10, sync_dtype)
    assert len(plan.buckets) > 4
    tdtype = getattr(torch, sync_dtype)
    steps, sources = build_steps(plan.buckets, local, maps, rank=0, dp_rank=0, edp_rank=0, dtype=tdtype,
                                 device=torch.device("cpu"))
    assert {s.slot for s in steps} == {0, 1}  # two send buffers, reused in turn
    for step in steps:
        step.flat.fill_(0xAB)  # poison: every byte must be written
        step.fill()
        want = torch.cat([split_full(maps[p.mcore_name], local[p.mcore_name].param.detach())[t.name]
                          .to(tdtype).contiguous().view(-1).view(torch.uint8)
                          for p in step.bucket.params for t in p.tensors])
        assert torch.equal(step.flat, want), step.bucket.index
        assert not step.gathers and not step.shard_in
    assert len(sources) == sum(len(b.params) for b in plan.buckets)  # every param read, once


def test_row_identity_params_are_one_copy_each(ckpt_dir):
    """Experts' [gate; up], down, norms: one contiguous copy per param; q/k/v: one per KV group and tensor."""
    bridge = get_bridge(ckpt_dir["stress_a"])
    vp = bridge.padded_vocab(128, 1)
    maps = {pm.mcore_name: pm for pm in bridge.param_maps(vp)}
    local = {n: LocalParam(n, torch.zeros(pm.shape), n, False, None, None) for n, pm in maps.items()}
    plan = _plan(bridge, vp, 1 << 30, "float32")
    ((step,), _) = build_steps(plan.buckets, local, maps, rank=0, dp_rank=0, edp_rank=0, dtype=torch.float32,
                               device=torch.device("cpu"))
    qkv = [p for p in plan.buckets[0].params if p.mcore_name.endswith("linear_qkv.weight")]
    groups = bridge.num_query_groups
    want = len(plan.buckets[0].params) - len(qkv) + len(qkv) * 3 * groups
    assert len(step.copy_out) == want and not step.copy_out.other_dst
    runs = hf_runs(maps[qkv[0].mcore_name], qkv[0])
    assert [r.hf for r in runs] == [0, 1, 2] * groups


def _tp_shards(pm, full: torch.Tensor, dim: int, ws: int) -> list[torch.Tensor]:
    """Megatron's TP shards of a full tensor: column-parallel (dim 0) = rank k's rows of every segment,
    row-parallel (dim 1) = rank k's block of columns."""
    if dim == 1:
        return [s.contiguous() for s in full.chunk(ws, dim=1)]
    rows = [sum(p.num_rows for p in seg) for seg in pm.segments]
    segs = full.split(rows, 0)
    return [torch.cat([s.chunk(ws, 0)[k] for s in segs], 0).contiguous() for k in range(ws)]


@pytest.mark.parametrize("chunk_kib", [0, 4, 16])
def test_chunked_gather_layout_rebuilds_the_full_tensors(ckpt_dir, chunk_kib):
    """The sender's side of a TP2 bucket, without a process group: rank k's part of chunk j is put at
    ``_Batch.slot(j, k)`` of the gather buffer by hand (what the receives write); the sender's own shards
    come from its params (column-parallel rows straight into the flat buffer, row-parallel ones through
    its slot). The flat buffers hold exactly the per-tensor path's bytes, for one chunk per batch and for several."""
    from mrl.megatron.parallel import GroupInfo
    from mrl.weight_sync.copy_plan import copy_out, participation

    bridge = get_bridge(ckpt_dir["stress_a"])
    ws = 2
    vp = bridge.padded_vocab(128, ws)
    maps = {pm.mcore_name: pm for pm in bridge.param_maps(vp)}
    group = GroupInfo(None, 0, ws)
    g = torch.Generator().manual_seed(1)
    fulls, shards, local = {}, {}, {}
    for n, pm in maps.items():
        fulls[n] = torch.randn(pm.shape, generator=g)
        dim = (1 if n.endswith(("linear_proj.weight", "linear_fc2.weight")) else
               0 if n.endswith(("linear_qkv.weight", "linear_fc1.weight", "word_embeddings.weight",
                                "output_layer.weight")) else None)
        shards[n] = _tp_shards(pm, fulls[n], dim, ws) if dim is not None else None
        param = shards[n][0] if dim is not None else fulls[n]
        local[n] = LocalParam(n, torch.nn.Parameter(param, requires_grad=False), n, ".experts." in n,
                              group if dim is not None else None, dim)
    plan = _plan(bridge, vp, 64 << 10, "float32")
    chunked = 0
    for bucket in plan.buckets:
        direct, batches = participation(bucket, local, maps, rank=0, dp_rank=0, edp_rank=0)
        for b in batches:
            b.split(chunk_kib * 256)  # fp32 elements
            chunked += len(b.chunks) > 1
            b.out = torch.full((b.numel * ws,), float("nan"))
            for lp, _, _, o in b.items:  # every rank's shard at its slot (rank 0's comes from its params)
                j = b.chunk_of(o)
                for k in range(1, ws):
                    at = b.slot(j, k) + o - b.chunks[j][0]
                    b.out[at:at + lp.param.numel()] = shards[lp.name][k].view(-1)
        flat = torch.full((bucket.nbytes // 4,), float("nan"))
        sc = copy_out(bucket, direct, batches, flat)
        sc.own_in.run()
        sc.local.run()
        for key in sorted(sc.per_chunk):
            sc.per_chunk[key].run()
        want = torch.cat([split_full(maps[p.mcore_name], fulls[p.mcore_name])[t.name].reshape(-1)
                          for p in bucket.params for t in p.tensors])
        assert torch.equal(flat, want), bucket.index
        # nothing of the sender's own column-parallel shards goes through the buffer
        assert len(sc.local) >= sum(1 for b in batches for lp, *_ in b.items if lp.partition_dim == 0)
    assert chunked if chunk_kib else not chunked
