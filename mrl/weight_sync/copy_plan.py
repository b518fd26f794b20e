"""Static copy plans of the weight-sync executor: where each byte of a bucket's flat send buffer
comes from (a local param, or the TP / expert-TP shards gathered to the sender), built once and
replayed every sync.

    steps, params = build_steps(order, local, maps, rank=r, dp_rank=d, edp_rank=e, dtype=torch.bfloat16,
                                device=dev)
    for step in steps:        # every sync, in the global bucket order
        step.fill()           # batched copies + one gather per (group, dtype); no Python per tensor
        if step.flat is not None:
            broadcast(step.flat)

Per bucket a rank replays at most: one ``_foreach_copy_`` of its shards into the gather input, one
gather to the group's rank 0 (the sender) per (shard group, dtype), and on the sender two
``_foreach_copy_`` into the flat buffer (contiguous same-dtype copies, which CUDA fuses into a few
kernels; then strided or casting ones). A gather, not an all-gather: only the sender needs the full
tensor, so the other ranks send their shards once and receive nothing. Buffers are allocated once:
one gather input, one gather output (sender), and two flat buffers per sender (bucket k+1 is filled
while bucket k is on the wire). Views of the params are cached, so the plan is valid while the
params keep their storage (``build_steps`` returns them, so the owner can check).

Byte layout (what SGLang's ``flattened_bucket`` expects): the bucket's HF tensors in bucket order,
each row-major in the sync dtype, no padding. It equals ``cat(split_full(pm, full))`` of the old path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mrl.megatron.weights import LocalParam
from mrl.models.bridge import ParamMap
from mrl.weight_sync.planner import Bucket, PlannedParam

_ALIGN = 64  # bytes: start of each gather region (any dtype view stays aligned)


@dataclass(frozen=True)
class Run:
    """Rows ``[full_row, full_row + rows)`` of the full (TP1) megatron tensor are rows
    ``[hf_row, hf_row + rows)`` of the param's HF tensor number ``hf``."""

    full_row: int
    hf: int
    hf_row: int
    rows: int


def hf_runs(pm: ParamMap, planned: PlannedParam) -> list[Run]:
    """The param map as row runs (padding rows, ``hf_name=None``, are dropped), in full-tensor order."""
    index = {t.name: i for i, t in enumerate(planned.tensors)}
    out, off = [], 0
    for seg in pm.segments:
        for part in seg:
            if part.hf_name is not None:
                out.append(Run(off, index[part.hf_name], part.start, part.num_rows))
            off += part.num_rows
    return out


@dataclass
class Copies:
    """``dst[i].copy_(src[i])`` for every pair, as at most two batched calls."""

    fused_dst: list[torch.Tensor] = field(default_factory=list)
    fused_src: list[torch.Tensor] = field(default_factory=list)
    """Contiguous, same dtype: CUDA's fused multi-tensor copy."""
    other_dst: list[torch.Tensor] = field(default_factory=list)
    other_src: list[torch.Tensor] = field(default_factory=list)
    """Strided (row-parallel column blocks) or casting."""

    def add(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        assert dst.shape == src.shape, (dst.shape, src.shape)
        fused = dst.dtype == src.dtype and dst.is_contiguous() and src.is_contiguous()
        (self.fused_dst if fused else self.other_dst).append(dst)
        (self.fused_src if fused else self.other_src).append(src)

    def __len__(self) -> int:
        return len(self.fused_dst) + len(self.other_dst)

    def run(self) -> None:
        if self.fused_dst:
            torch._foreach_copy_(self.fused_dst, self.fused_src)
        if self.other_dst:
            torch._foreach_copy_(self.other_dst, self.other_src)


class _Flat1D:
    """Contiguous element ranges ``base[src:src+n] -> dst[off:off+n]``, merged while both sides continue."""

    def __init__(self) -> None:
        self.ranges: list[list] = []  # [src base, src offset, dst offset, numel]

    def add(self, base: torch.Tensor, src: int, dst: int, n: int) -> None:
        last = self.ranges[-1] if self.ranges else None
        if last is not None and last[0] is base and last[1] + last[3] == src and last[2] + last[3] == dst:
            last[3] += n
        else:
            self.ranges.append([base, src, dst, n])

    def into(self, copies: Copies, flat: torch.Tensor) -> None:
        for base, src, dst, n in self.ranges:
            copies.add(flat[dst:dst + n], base[src:src + n])


class _Strided:
    """Row-parallel copies (``dst`` a column block of an HF tensor, ``src`` a gathered shard), where
    consecutive ones of the same shape sit at evenly spaced offsets on both sides (one tensor of every
    expert of a bucket) merged into one copy with a leading dim: one kernel, not one per expert."""

    def __init__(self) -> None:
        # [dst base, src base, sizes, dst strides, src strides, dst offset, src offset, count, dst step, src step]
        self.groups: list[list] = []

    def add(self, dst: torch.Tensor, dst_off: int, dst_strides: tuple, src: torch.Tensor, src_off: int,
            src_strides: tuple, sizes: tuple) -> None:
        g = self.groups[-1] if self.groups else None
        if g is not None and g[0] is dst and g[1] is src and g[2:5] == [sizes, dst_strides, src_strides]:
            d_step, s_step = dst_off - g[5] - (g[7] - 1) * g[8], src_off - g[6] - (g[7] - 1) * g[9]
            if g[7] == 1 and d_step > 0 and s_step > 0:
                g[7:10] = [2, d_step, s_step]
                return
            if g[7] > 1 and (d_step, s_step) == (g[8], g[9]):
                g[7] += 1
                return
        self.groups.append([dst, src, sizes, dst_strides, src_strides, dst_off, src_off, 1, 0, 0])

    def into(self, copies: Copies) -> None:
        for dst, src, sizes, d_str, s_str, d_off, s_off, count, d_step, s_step in self.groups:
            copies.add(dst.as_strided((count, *sizes), (d_step, *d_str), d_off),
                       src.as_strided((count, *sizes), (s_step, *s_str), s_off))


@dataclass
class GatherOp:
    """Shards of one (group, dtype) to the group's rank 0: NCCL's gather, or on gloo (whose gather is
    ~3x slower than its send/recv) a send per rank, received in place on rank 0."""

    group: dist.ProcessGroup
    ranks: list[int]
    """Global ranks of the group's ranks."""
    inp: torch.Tensor
    outs: list[torch.Tensor] | None
    """On the group's rank 0: one view per group rank into the gather output (gloo: ``inp`` is outs[0])."""
    p2p: bool

    def run(self) -> None:
        if not self.p2p:
            dist.gather(self.inp, self.outs, dst=self.ranks[0], group=self.group)
        elif self.outs is None:
            dist.send(self.inp, dst=self.ranks[0], group=self.group)
        else:
            for w in [dist.irecv(o, src=r, group=self.group) for o, r in zip(self.outs[1:], self.ranks[1:])]:
                w.wait()


@dataclass
class BucketStep:
    """One bucket as this rank replays it: gathers it joins and, on the sender, the flat buffer."""

    bucket: Bucket
    shard_in: Copies
    gathers: list[GatherOp]
    copy_out: Copies
    flat: torch.Tensor | None
    """uint8 view of the bucket's bytes (sender only), in one of the reused send buffers."""
    slot: int | None
    """Which send buffer ``flat`` lives in (sender only)."""

    def fill(self) -> None:
        self.shard_in.run()
        for g in self.gathers:
            g.run()
        self.copy_out.run()


@dataclass
class _Batch:
    """TP-split params of one bucket sharing a (group, dtype): one gather."""

    group: object  # GroupInfo
    dtype: torch.dtype
    items: list = field(default_factory=list)  # (LocalParam, ParamMap, PlannedParam, element offset)
    numel: int = 0
    in_byte: int = 0
    out_byte: int = 0
    out: torch.Tensor | None = None
    """The gather output (group rank 0): rank k's shards at ``[k * numel, (k + 1) * numel)``."""


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _participation(bucket: Bucket, local: dict[str, LocalParam], maps: dict[str, ParamMap], *, rank: int,
                   dp_rank: int, edp_rank: int) -> tuple[list, list[_Batch]]:
    """(direct params the sender copies itself, gather batches this rank joins), in bucket order.
    The same selection rules as the export path: DP (expert-DP) replica 0 gathers; replicated params
    are read by the sender only."""
    direct, batches = [], {}
    for p in bucket.params:
        lp = local.get(p.mcore_name)
        if lp is None or (edp_rank if lp.is_expert else dp_rank) != 0:
            continue
        if lp.shard_group is None:
            if rank == bucket.sender:
                direct.append((lp, maps[p.mcore_name], p))
            continue
        b = batches.setdefault((id(lp.shard_group.group), lp.param.dtype), _Batch(lp.shard_group, lp.param.dtype))
        b.items.append((lp, maps[p.mcore_name], p, b.numel))
        b.numel += lp.param.numel()
    return direct, list(batches.values())


def _flat_view(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(f"weight sync needs contiguous params, got strides {t.stride()} for shape {tuple(t.shape)}")
    return t.detach().view(-1)


def _hf_offsets(bucket: Bucket) -> dict[str, list[int]]:
    """Element offset of every HF tensor of the bucket in its flat buffer, per megatron param."""
    out, off = {}, 0
    for p in bucket.params:
        offs = []
        for t in p.tensors:
            offs.append(off)
            n = 1
            for d in t.shape:
                n *= d
            off += n
        out[p.mcore_name] = offs
    return out


def _copy_out(bucket: Bucket, direct: list, batches: list[_Batch], flat: torch.Tensor) -> Copies:
    """Pairs (flat slice <- param rows or gathered shard rows) for the whole bucket, in bucket order."""
    offsets = _hf_offsets(bucket)
    ranges, strided = _Flat1D(), _Strided()
    sources = {p.mcore_name: ("direct", lp, pm) for lp, pm, p in direct}
    for b in batches:
        for lp, pm, p, o in b.items:
            sources[p.mcore_name] = ("gathered", lp, pm, b, o)
    for p in bucket.params:
        src = sources[p.mcore_name]
        kind, lp, pm = src[:3]
        cols = pm.num_cols or 1
        hf_off = offsets[p.mcore_name]
        runs = hf_runs(pm, p)
        if kind == "direct":
            base = _flat_view(lp.param)
            for r in runs:
                ranges.add(base, r.full_row * cols, hf_off[r.hf] + r.hf_row * cols, r.rows * cols)
            continue
        b, o = src[3], src[4]
        assert b.out is not None, "the sender is rank 0 of its shard groups"
        ws, n = b.group.size, b.numel
        if lp.partition_dim == 1:  # row-parallel: full[:, k*c:(k+1)*c] is rank k's shard
            c = cols // ws
            for r in runs:  # dst [k, row, :] = hf[row, k*c:(k+1)*c]; src [k, row, :] = shard k's row
                strided.add(flat, flat.storage_offset() + hf_off[r.hf] + r.hf_row * cols, (c, cols, 1),
                            b.out, b.out.storage_offset() + o + r.full_row * c, (n, c, 1), (ws, r.rows, c))
            continue
        # column-parallel: each segment of the full tensor is [rank 0's chunk; rank 1's chunk; ...], and
        # each rank's shard is [its chunk of segment 0; its chunk of segment 1; ...]
        seg_rows = [sum(part.num_rows for part in seg) for seg in pm.segments]
        chunk = [s // ws for s in seg_rows]
        seg_start = [sum(seg_rows[:i]) for i in range(len(seg_rows))]
        shard_prefix = [sum(chunk[:i]) for i in range(len(chunk))]
        for r in runs:
            s = max(i for i, st in enumerate(seg_start) if st <= r.full_row)
            local, rows, hf_row = r.full_row - seg_start[s], r.rows, r.hf_row
            while rows:
                k, within = divmod(local, chunk[s])
                take = min(rows, chunk[s] - within)
                ranges.add(b.out, k * n + o + (shard_prefix[s] + within) * cols, hf_off[r.hf] + hf_row * cols,
                           take * cols)
                local, rows, hf_row = local + take, rows - take, hf_row + take
    copies = Copies()
    ranges.into(copies, flat)
    strided.into(copies)
    return copies


def build_steps(order: list[Bucket], local: dict[str, LocalParam], maps: dict[str, ParamMap], *, rank: int,
                dp_rank: int, edp_rank: int, dtype: torch.dtype, device: torch.device,
                num_send_buffers: int = 2) -> tuple[list[BucketStep], list[torch.Tensor]]:
    """This rank's steps for ``order`` (every bucket touching its stage, in the global order), and the
    local params the steps read (their storage must not move while the steps are used)."""
    elem = torch.empty((), dtype=dtype).element_size()
    plans, gin_bytes, gout_bytes, flat_bytes = [], 0, 0, 0
    for bucket in order:
        direct, batches = _participation(bucket, local, maps, rank=rank, dp_rank=dp_rank, edp_rank=edp_rank)
        if not direct and not batches and rank != bucket.sender:
            continue
        gin = gout = 0
        for b in batches:
            b.in_byte, b.out_byte = gin, gout
            item = torch.empty((), dtype=b.dtype).element_size()
            gin, gout = _align(gin + b.numel * item), _align(gout + b.numel * item * b.group.size)
        gin_bytes = max(gin_bytes, gin)
        if any(b.group.rank == 0 for b in batches):
            gout_bytes = max(gout_bytes, gout)
        if rank == bucket.sender:
            flat_bytes = max(flat_bytes, bucket.nbytes)
        plans.append((bucket, direct, batches))
    gin_buf = torch.empty(gin_bytes, dtype=torch.uint8, device=device)
    gout_buf = torch.empty(gout_bytes, dtype=torch.uint8, device=device)
    num_sends = sum(1 for bucket, _, _ in plans if bucket.sender == rank)
    send_bufs = [torch.empty(flat_bytes, dtype=torch.uint8, device=device)
                 for _ in range(min(num_send_buffers, num_sends))]
    steps, sources, sends = [], [], 0
    for bucket, direct, batches in plans:
        shard_in, gathers = Copies(), []
        for b in batches:
            item = torch.empty((), dtype=b.dtype).element_size()
            inp = gin_buf[b.in_byte:b.in_byte + b.numel * item].view(b.dtype)
            outs = None
            p2p = dist.get_backend(b.group.group) == "gloo"
            if b.group.rank == 0:
                b.out = gout_buf[b.out_byte:b.out_byte + b.numel * item * b.group.size].view(b.dtype)
                outs = list(b.out.split(b.numel))
                if p2p:
                    inp = outs[0]
            for lp, _, _, o in b.items:
                src = _flat_view(lp.param)
                shard_in.add(inp[o:o + src.numel()], src)
                sources.append(lp.param)
            ranks = [dist.get_global_rank(b.group.group, k) for k in range(b.group.size)]
            gathers.append(GatherOp(b.group.group, ranks, inp, outs, p2p))
        flat, slot, copy_out = None, None, Copies()
        if rank == bucket.sender:
            slot = sends % len(send_bufs)
            sends += 1
            flat = send_bufs[slot][:bucket.nbytes]
            assert bucket.nbytes % elem == 0
            copy_out = _copy_out(bucket, direct, batches, flat.view(dtype))
            sources += [lp.param for lp, _, _ in direct]
        steps.append(BucketStep(bucket, shard_in, gathers, copy_out, flat, slot))
    return steps, sources
