"""Static copy plans of the weight-sync executor: where each byte of a bucket's flat send buffer
comes from (a local param, or the TP / expert-TP shards gathered to the sender), built once and
replayed every sync.

    steps, params = build_steps(order, local, maps, rank=r, dp_rank=d, edp_rank=e, dtype=torch.bfloat16,
                                device=dev)
    for step in steps:        # every sync, in the global bucket order
        step.fill()           # batched copies + shard transfers to the sender; no Python per tensor
        if step.flat is not None:
            broadcast(step.flat)

Shards go to the group's rank 0 (the sender) only: the other ranks send theirs once and receive
nothing. Each other rank packs its shards of a (group, dtype) batch (one ``_foreach_copy_``) and sends
them point to point; the sender posts every receive of the bucket first, then copies its own shards
straight from its params into the flat buffer while they arrive (column-parallel rows are contiguous
there; row-parallel ones are staged in its own slot of the gather buffer), then waits for the others'
and copies them out. The sender never copies its own shards through the transfer. A batch can be split
into chunks of whole params (``chunk_bytes``), so the sender's copies of chunk j run while chunk j+1 is
on the wire; by default a batch is one transfer, since every transfer costs host time.

Per bucket a rank replays at most: one batched copy of the sender's local bytes, per chunk one pack
(senders of shards) and one or two batched copies out (contiguous same-dtype copies, which CUDA fuses
into a few kernels; then strided or casting ones: one per run of equally spaced, equally shaped
row-parallel shards, i.e. one tensor of every expert of the chunk at once). Buffers are allocated
once: one gather input, one gather output (sender), and two flat buffers per sender (bucket k+1 is
filled while bucket k is on the wire). Views of the params are cached, so the plan is valid while the
params keep their storage (``build_steps`` returns them, so the owner can check).

Gather-buffer layout of a (group, dtype) batch: chunk j (params ``[s_j, e_j)`` of the packed shard
order) at ``ws * s_j``, rank k's part of it at ``ws * s_j + k * (e_j - s_j)`` (exactly what
a receive per rank of the chunk writes).

In-place buckets (``Bucket.inplace``, planned from ``placement``): the sender's params already hold
the bucket's bytes back to back (megatron's DDP parameter buffer, params in the sync dtype whose HF
tensors need no regrouping: experts at expert-TP 1, embeddings, norms, o_proj at TP 1), so ``flat``
is a view of that memory and the bucket costs no copy. If the params have moved since the plan was
made (an offload and reload), the bucket is filled by copies like any other.

FP8 buckets (a block-FP8 engine, ``mrl.weight_sync.fp8``): the copies fill a staging buffer laid out as
the bucket in the sync dtype (``staged_bucket``), and the bucket's last step quantizes it into the flat
buffer (e4m3 codes and fp32 scales, each weight's pair where the plan puts it). Such buckets never go in
place: the params hold bf16, not what goes on the wire.

Byte layout of a flat buffer (what SGLang's ``flattened_bucket`` expects): the bucket's HF tensors in
bucket order, each row-major in the sync dtype, no padding. It equals ``cat(split_full(pm, full))``
of the per-tensor path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mrl.megatron.weights import LocalParam
from mrl.models.bridge import ParamMap
from mrl.weight_sync.copies import Copies, Flat1D, Strided
from mrl.weight_sync.fp8 import BucketQuantizer, has_fp8, staged_bucket
from mrl.weight_sync.planner import Bucket, Placement, PlannedParam

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


def inplace_numel(pm: ParamMap, planned: PlannedParam) -> int | None:
    """Elements at the start of the full megatron tensor that are ``planned``'s HF tensors back to back
    (trailing padding rows, e.g. of the vocab, may follow); None when they need regrouping (QKV)."""
    runs, cols, rows = hf_runs(pm, planned), pm.num_cols or 1, 0
    if len(runs) != len(planned.tensors):
        return None
    for i, (r, t) in enumerate(zip(runs, planned.tensors)):
        if r.hf != i or r.hf_row != 0 or r.full_row != rows or r.rows != t.shape[0]:
            return None
        rows += r.rows
    return rows * cols


def placement(lp: LocalParam, pm: ParamMap, planned: PlannedParam, dtype: torch.dtype) -> Placement | None:
    """Where the sender holds ``planned``'s bytes as they go on the wire, if it does."""
    t = lp.param
    wire = str(dtype).removeprefix("torch.")  # FP8 entries (e4m3 codes, scales) are made, never held
    same = t.dtype == dtype and all(x.dtype == wire for x in planned.tensors)
    n = inplace_numel(pm, planned) if lp.shard_group is None and same and t.is_contiguous() else None
    return None if n is None else Placement(t.untyped_storage().data_ptr(), t.storage_offset(), n)


def _inplace_view(bucket: Bucket, direct: list, dtype: torch.dtype) -> torch.Tensor | None:
    """uint8 view of the bucket's bytes in the sender's params, if they (still) lie back to back."""
    if len(direct) != len(bucket.params):
        return None
    at = [placement(lp, pm, p, dtype) for lp, pm, p in direct]
    if None in at or any(b.storage != a.storage or a.offset + a.numel != b.offset for a, b in zip(at, at[1:])):
        return None
    first = direct[0][0].param.detach()
    n = sum(a.numel for a in at)
    return first.as_strided((n,), (1,), first.storage_offset()).view(torch.uint8)


@dataclass
class GatherOp:
    """One chunk of one (group, dtype) batch: this rank's pack and send or, on the sender, its receives
    and the chunk's copies into the flat buffer once it has arrived."""

    group: dist.ProcessGroup
    ranks: list[int]
    """Global ranks of the group's ranks (rank 0 receives)."""
    pack: Copies
    """This rank's shards of the chunk into ``inp`` (the receiver packs nothing here)."""
    inp: torch.Tensor | None
    out: torch.Tensor | None
    """The chunk's region of the gather output, ``[ws * chunk]`` (receiver only)."""
    copy_out: Copies
    """Receiver: the chunk's bytes into the flat buffer."""
    tag: int
    receiver: bool
    """Group rank 0: the bucket's sender."""

    def start(self) -> list:
        """Pack and launch the transfer (async); the works to wait on."""
        self.pack.run()
        ws = len(self.ranks)
        if not self.receiver:
            return [dist.isend(self.inp, dst=self.ranks[0], group=self.group, tag=self.tag)]
        n = self.out.numel() // ws
        return [dist.irecv(self.out[k * n:(k + 1) * n], src=self.ranks[k], group=self.group, tag=self.tag)
                for k in range(1, ws)]

    def finish(self, works: list) -> None:
        for w in works:
            w.wait()  # NCCL: the current stream waits (no host sync); gloo: the host waits
        self.copy_out.run()


@dataclass
class BucketStep:
    """One bucket as this rank replays it: the transfers it joins and, on the sender, the flat buffer."""

    bucket: Bucket
    shard_in: Copies
    """Sender: its own row-parallel shards into its slot of the gather buffer."""
    gathers: list[GatherOp]
    copy_out: Copies
    """Sender: the bytes it holds itself (replicated params, its own column-parallel shards) into
    the flat buffer. The gathered bytes are copied out per chunk (``GatherOp.copy_out``)."""
    flat: torch.Tensor | None
    """uint8 view of the bucket's bytes (sender only), in one of the reused send buffers."""
    slot: int | None
    """Which send buffer ``flat`` lives in (sender only); negative: ``flat`` is a view of the params."""
    quantize: Callable[[], None] | None = None
    """FP8 buckets (sender only): the copies fill a staging buffer in the sync dtype; this writes the
    bucket's e4m3 codes and scales from it into ``flat`` (``mrl.weight_sync.fp8.BucketQuantizer``)."""

    @property
    def in_place(self) -> bool:
        return self.slot is not None and self.slot < 0

    def fill(self) -> None:
        # the receives first: the shards are on the wire while the sender copies its own bytes
        posted = {id(op): op.start() for op in self.gathers if op.receiver}
        self.shard_in.run()
        self.copy_out.run()
        last, sent = None, []
        for op in self.gathers:
            works = posted.pop(id(op), None)
            if works is None:
                works = op.start()
            if op.receiver:  # copy out the previous chunk while this one travels
                if last is not None:
                    last[0].finish(last[1])
                last = (op, works)
            else:
                sent += works
        if last is not None:
            last[0].finish(last[1])
        for w in sent:  # NCCL: the stream waits (the next pack reuses the buffer); gloo: the host waits
            w.wait()
        if self.quantize is not None:
            self.quantize()


@dataclass
class _Batch:
    """TP-split params of one bucket sharing a (group, dtype): one transfer per chunk."""

    group: object  # GroupInfo
    dtype: torch.dtype
    items: list = field(default_factory=list)  # (LocalParam, ParamMap, PlannedParam, element offset)
    numel: int = 0
    in_byte: int = 0
    out_byte: int = 0
    chunks: list = field(default_factory=list)
    """Element ranges ``(start, end)`` of the packed shard order, whole params each."""
    out: torch.Tensor | None = None
    """The gather output (receiver only), chunk-major (module docstring)."""

    def split(self, chunk_elems: int) -> None:
        self.chunks = []
        for _, _, _, o in self.items:
            if not self.chunks or (chunk_elems > 0 and o - self.chunks[-1][0] >= chunk_elems):
                self.chunks.append([o, o])
        for c, nxt in zip(self.chunks, [c[0] for c in self.chunks[1:]] + [self.numel]):
            c[1] = nxt
        self.chunks = [tuple(c) for c in self.chunks]

    def chunk_of(self, o: int) -> int:
        return max(j for j, (s, _) in enumerate(self.chunks) if s <= o)

    def slot(self, j: int, k: int) -> int:
        """Element offset, in ``out``, of rank k's part of chunk j."""
        s, e = self.chunks[j]
        return self.group.size * s + k * (e - s)


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def participation(bucket: Bucket, local: dict[str, LocalParam], maps: dict[str, ParamMap], *, rank: int,
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


@dataclass
class _SenderCopies:
    own_in: Copies
    """The sender's own row-parallel shards into its slot of the gather buffer."""
    local: Copies
    """Into the flat buffer, from the sender's own params."""
    per_chunk: dict
    """(batch index, chunk) -> Copies into the flat buffer, from the gather buffer."""


def copy_out(bucket: Bucket, direct: list, batches: list[_Batch], flat: torch.Tensor) -> _SenderCopies:
    """Pairs (flat slice <- param rows or gathered shard rows) for the whole bucket, in bucket order. The
    sender's own shards come from its params, not through the gather buffer."""
    offsets = _hf_offsets(bucket)
    local_ranges, own_in = Flat1D(), Copies()
    ranges = {(i, j): Flat1D() for i, b in enumerate(batches) for j in range(len(b.chunks))}
    strided = {key: Strided() for key in ranges}
    sources = {p.mcore_name: ("direct", lp, pm) for lp, pm, p in direct}
    for i, b in enumerate(batches):
        for lp, pm, p, o in b.items:
            sources[p.mcore_name] = ("gathered", lp, pm, i, o)
    for p in bucket.params:
        src = sources[p.mcore_name]
        kind, lp, pm = src[:3]
        cols = pm.num_cols or 1
        hf_off = offsets[p.mcore_name]
        runs = hf_runs(pm, p)
        if kind == "direct":
            base = _flat_view(lp.param)
            for r in runs:
                local_ranges.add(base, r.full_row * cols, hf_off[r.hf] + r.hf_row * cols, r.rows * cols)
            continue
        i, o = src[3], src[4]
        b = batches[i]
        assert b.out is not None, "the sender is rank 0 of its shard groups"
        ws = b.group.size
        j = b.chunk_of(o)
        within_chunk = o - b.chunks[j][0]
        chunk_len = b.chunks[j][1] - b.chunks[j][0]
        mine = _flat_view(lp.param)
        if lp.partition_dim == 1:  # row-parallel: full[:, k*c:(k+1)*c] is rank k's shard
            c = cols // ws
            at = b.slot(j, 0) + within_chunk
            own_in.add(b.out[at:at + mine.numel()], mine)
            for r in runs:  # dst [k, row, :] = hf[row, k*c:(k+1)*c]; src [k, row, :] = shard k's row
                strided[i, j].add(flat, flat.storage_offset() + hf_off[r.hf] + r.hf_row * cols, (c, cols, 1),
                                  b.out, b.out.storage_offset() + at + r.full_row * c, (chunk_len, c, 1),
                                  (ws, r.rows, c))
            continue
        # column-parallel: each segment of the full tensor is [rank 0's chunk; rank 1's chunk; ...], and
        # each rank's shard is [its chunk of segment 0; its chunk of segment 1; ...]
        seg_rows = [sum(part.num_rows for part in seg) for seg in pm.segments]
        chunk = [s // ws for s in seg_rows]
        seg_start = [sum(seg_rows[:i]) for i in range(len(seg_rows))]
        shard_prefix = [sum(chunk[:i]) for i in range(len(chunk))]
        for r in runs:
            s = max(i for i, st in enumerate(seg_start) if st <= r.full_row)
            loc, rows, hf_row = r.full_row - seg_start[s], r.rows, r.hf_row
            while rows:
                k, within = divmod(loc, chunk[s])
                take = min(rows, chunk[s] - within)
                src_el, dst_el = (shard_prefix[s] + within) * cols, hf_off[r.hf] + hf_row * cols
                if k == 0:
                    local_ranges.add(mine, src_el, dst_el, take * cols)
                else:
                    ranges[i, j].add(b.out, b.slot(j, k) + within_chunk + src_el, dst_el, take * cols)
                loc, rows, hf_row = loc + take, rows - take, hf_row + take
    local = Copies()
    local_ranges.into(local, flat)
    per_chunk = {}
    for key in ranges:
        per_chunk[key] = Copies()
        ranges[key].into(per_chunk[key], flat)
        strided[key].into(per_chunk[key])
    return _SenderCopies(own_in, local, per_chunk)


def build_steps(order: list[Bucket], local: dict[str, LocalParam], maps: dict[str, ParamMap], *, rank: int,
                dp_rank: int, edp_rank: int, dtype: torch.dtype, device: torch.device,
                num_send_buffers: int = 2, chunk_bytes: int = 0) -> tuple[list[BucketStep], list[torch.Tensor]]:
    """This rank's steps for ``order`` (every bucket touching its stage, in the global order), and the
    local params the steps read (their storage must not move while the steps are used).
    ``chunk_bytes``: split each (group, dtype) batch into transfers of about this size (0: one per batch)."""
    elem = torch.empty((), dtype=dtype).element_size()
    plans, gin_bytes, gout_bytes, flat_bytes, staging_bytes = [], 0, 0, 0, 0
    wire = str(dtype).removeprefix("torch.")
    for bucket in order:
        direct, batches = participation(bucket, local, maps, rank=rank, dp_rank=dp_rank, edp_rank=edp_rank)
        if not direct and not batches and rank != bucket.sender:
            continue
        gin = gout = 0
        for b in batches:
            item = torch.empty((), dtype=b.dtype).element_size()
            b.split(chunk_bytes // item)
            b.in_byte, b.out_byte = gin, gout
            gin = _align(gin + b.numel * item)
            if b.group.rank == 0:
                gout = _align(gout + b.numel * item * b.group.size)
        gin_bytes, gout_bytes = max(gin_bytes, gin), max(gout_bytes, gout)
        view = _inplace_view(bucket, direct, dtype) if bucket.inplace and rank == bucket.sender else None
        if rank == bucket.sender and view is None:
            flat_bytes = max(flat_bytes, bucket.nbytes)
            if has_fp8(bucket):
                staging_bytes = max(staging_bytes, staged_bucket(bucket, wire).nbytes)
        plans.append((bucket, direct, batches, view))
    gin_buf = torch.empty(gin_bytes, dtype=torch.uint8, device=device)
    gout_buf = torch.empty(gout_bytes, dtype=torch.uint8, device=device)
    num_sends = sum(1 for bucket, _, _, view in plans if bucket.sender == rank and view is None)
    send_bufs = [torch.empty(flat_bytes, dtype=torch.uint8, device=device)
                 for _ in range(min(num_send_buffers, num_sends))]
    # one is enough: a bucket's quantization reads it before the next bucket's copies write it (same stream)
    staging = torch.empty(staging_bytes, dtype=torch.uint8, device=device)
    steps, sources, sends = [], [], 0
    for bucket, direct, batches, view in plans:
        for b in batches:
            item = torch.empty((), dtype=b.dtype).element_size()
            if b.group.rank == 0:
                b.out = gout_buf[b.out_byte:b.out_byte + b.numel * item * b.group.size].view(b.dtype)
            sources += [lp.param for lp, _, _, _ in b.items]
        flat, slot, sc, quantize = None, None, None, None
        if view is not None:  # its own slot: no later bucket waits for this one's broadcast
            flat, slot, sc = view, -1 - len(steps), _SenderCopies(Copies(), Copies(), {})
            sources += [lp.param for lp, _, _ in direct]
        elif rank == bucket.sender:
            slot = sends % len(send_bufs)
            sends += 1
            flat = send_bufs[slot][:bucket.nbytes]
            if has_fp8(bucket):  # gathered in the sync dtype as the bf16 bucket, then quantized into flat
                staged = staged_bucket(bucket, wire)
                dst = staging[:staged.nbytes].view(dtype)
                quantize = BucketQuantizer(bucket, dst, flat, wire)
                sc = copy_out(staged, direct, batches, dst)
            else:
                assert bucket.nbytes % elem == 0
                sc = copy_out(bucket, direct, batches, flat.view(dtype))
            sources += [lp.param for lp, _, _ in direct]
        gathers, same_group = [], {}
        for i, b in enumerate(batches):
            # tag: the chunk and the batch's place among this group's batches (same on every rank of
            # the group, whatever other groups this rank joins); gloo matches on it, NCCL keeps order
            nth = same_group.setdefault(id(b.group.group), [0])
            nth[0] += 1
            item = torch.empty((), dtype=b.dtype).element_size()
            receiver = b.group.rank == 0
            ranks = [dist.get_global_rank(b.group.group, k) for k in range(b.group.size)]
            gin = gin_buf[b.in_byte:b.in_byte + b.numel * item].view(b.dtype)
            for j, (s, e) in enumerate(b.chunks):
                pack = Copies()
                packs = not receiver
                if packs:
                    for lp, _, _, o in b.items:
                        if s <= o < e:
                            src = _flat_view(lp.param)
                            pack.add(gin[o:o + src.numel()], src)
                out = None if b.out is None else b.out[b.slot(j, 0):b.slot(j, 0) + (e - s) * b.group.size]
                gathers.append(GatherOp(b.group.group, ranks, pack, gin[s:e] if packs else None, out,
                                        sc.per_chunk[i, j] if sc is not None and receiver else Copies(),
                                        tag=j * 16 + nth[0] - 1, receiver=receiver))
        steps.append(BucketStep(bucket, sc.own_in if sc else Copies(), gathers, sc.local if sc else Copies(),
                                flat, slot, quantize))
    return steps, sources
