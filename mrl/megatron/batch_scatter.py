"""Rank 0's step batch to the trainer ranks: each rank receives only the samples its DP rank trains on.

    scatter = BatchScatter(dp_rank=layout.dp.rank, dp_size=layout.dp.size, group=dist.group.WORLD)  # collective
    batch, normalizer, info = scatter.deliver(built if rank == 0 else None, what="the step-3 batch")

Every rank gets a small header as one pickled object (the sizes of every sample's fields, prompt lengths,
advantages, the loss normalizer, the step's info figures, and the ``WholeBatch`` figures its micro-batch
plan needs); the bulk goes point to point from rank 0, one contiguous byte buffer per destination: tokens,
engine logprobs, routes, sampling supports (ragged: counts and ids), loss masks, token versions, per-token
advantages, reference engines' logprobs, each field in its own dtype (uint8 routes stay uint8). Ranks of one DP
rank (TP, PP, CP peers) receive the same share: megatron's dense DP group holds the EP peers too, so an EP rank
is a DP rank here. On NCCL the buffers travel as device tensors (rank 0 fills a pinned host buffer and copies it
to its device). A one-rank world sends nothing.

The receiving side rebuilds an ``RLBatch`` of its samples (``first``, ``whole`` set); ``Policy`` plans the
same micro-batches from it as from the whole batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from mrl.megatron.batch import RLBatch, WholeBatch, dp_share
from mrl.megatron.collectives import group_timeout, named

ALIGN = 8
"""Each field starts at a multiple of this many bytes: a typed view of the buffer is aligned."""


@dataclass(frozen=True)
class FieldSpec:
    """One bulk field: every sample's rows of ``tail``-shaped ``dtype`` elements."""

    name: str
    dtype: str
    rows: tuple[int, ...]
    """Rows of each sample of the whole batch."""
    tail: tuple[int, ...] = ()

    @property
    def row_bytes(self) -> int:
        return np.dtype(self.dtype).itemsize * math.prod(self.tail)


@dataclass(frozen=True)
class Header:
    """What every rank receives as a pickled object: small, whatever the batch's token count."""

    whole: WholeBatch
    prompt_lens: list[int]
    advantages: list[float]
    fields: tuple[FieldSpec, ...]
    normalizer: float
    info: dict[str, Any]

    def field(self, name: str) -> FieldSpec | None:
        return next((f for f in self.fields if f.name == name), None)


# each field's values of sample i, as the batch holds them
_SOURCES: dict[str, Callable[[RLBatch, int], Any]] = {
    "tokens": lambda b, i: b.tokens[i],
    "behav_logp": lambda b, i: b.behav_logp[i],
    "routes": lambda b, i: b.routes[i],
    "support_counts": lambda b, i: [len(kept) for kept in b.support[i]],
    "support_ids": lambda b, i: [t for kept in b.support[i] for t in kept],
    "support_log_mass": lambda b, i: b.support_log_mass[i],
    "loss_mask": lambda b, i: b.loss_mask[i],
    "versions": lambda b, i: b.versions[i],
    "token_advantages": lambda b, i: b.token_advantages[i],
    "ref_logp": lambda b, i: b.ref_logp[i],
}


def _per_sample(batch: RLBatch, name: str, values: list | None) -> list | None:
    if values is not None and len(values) != len(batch):
        raise ValueError(f"RLBatch.{name} has {len(values)} entries for {len(batch)} samples")
    return values


def _routes_spec(routes: list) -> FieldSpec:
    dtypes = {np.asarray(r).dtype.str for r in routes}
    tails = {np.shape(r)[1:] for r in routes}
    if len(dtypes) > 1 or len(tails) > 1 or any(np.ndim(r) != 3 for r in routes):
        raise ValueError(f"RLBatch.routes: every sample's routes must be [n - 1, moe_layers, K] of one dtype, got "
                         f"dtypes {sorted(dtypes)} and [moe_layers, K] {sorted(tails)}")
    return FieldSpec("routes", np.dtype(dtypes.pop()).name, tuple(len(r) for r in routes), tails.pop())


def make_header(batch: RLBatch, normalizer: float, info: dict[str, Any], dp_size: int) -> Header:
    """The header of a whole batch (rank 0); fails naming the field when the batch is inconsistent."""
    if batch.whole is not None:
        raise ValueError("make_header: the batch is already one DP rank's share (RLBatch.whole is set)")
    n = len(batch)
    dp_share(n, dp_size, 0)  # n splits over dp
    for name in ("prompt_lens", "behav_logp", "advantages"):
        _per_sample(batch, name, getattr(batch, name))
    fields = [FieldSpec("tokens", "int32", tuple(len(t) for t in batch.tokens)),
              FieldSpec("behav_logp", "float64", tuple(len(x) for x in batch.behav_logp))]
    if _per_sample(batch, "routes", batch.routes) is not None:
        fields.append(_routes_spec(batch.routes))
    if _per_sample(batch, "support", batch.support) is not None:
        fields += [FieldSpec("support_counts", "int32", tuple(len(s) for s in batch.support)),
                   FieldSpec("support_ids", "int32", tuple(sum(map(len, s)) for s in batch.support))]
    if _per_sample(batch, "support_log_mass", batch.support_log_mass) is not None:
        fields.append(FieldSpec("support_log_mass", "float64", tuple(len(x) for x in batch.support_log_mass)))
    if _per_sample(batch, "loss_mask", batch.loss_mask) is not None:
        fields.append(FieldSpec("loss_mask", "uint8", tuple(len(x) for x in batch.loss_mask)))
    if _per_sample(batch, "versions", batch.versions) is not None:
        fields.append(FieldSpec("versions", "int32", tuple(len(x) for x in batch.versions)))
    if _per_sample(batch, "token_advantages", batch.token_advantages) is not None:
        fields.append(FieldSpec("token_advantages", "float64", tuple(len(x) for x in batch.token_advantages)))
    if _per_sample(batch, "ref_logp", batch.ref_logp) is not None:
        fields.append(FieldSpec("ref_logp", "float64", tuple(len(x) for x in batch.ref_logp)))
    return Header(whole=WholeBatch.of(batch), prompt_lens=list(batch.prompt_lens),
                  advantages=[float(a) for a in batch.advantages], fields=tuple(fields),
                  normalizer=float(normalizer), info=dict(info))


def layout(header: Header, share: range) -> tuple[list[tuple[FieldSpec, int, int]], int]:
    """``(field, byte offset, rows)`` of each field in the buffer of ``share``'s samples, and its size."""
    out, at = [], 0
    for f in header.fields:
        at = -(-at // ALIGN) * ALIGN
        rows = sum(f.rows[i] for i in share)
        out.append((f, at, rows))
        at += rows * f.row_bytes
    return out, at


def _typed(buf: np.ndarray, f: FieldSpec, offset: int, rows: int) -> np.ndarray:
    return buf[offset:offset + rows * f.row_bytes].view(f.dtype).reshape(rows, *f.tail)


def _put(dst: np.ndarray, values, f: FieldSpec, i: int) -> None:
    """Sample ``i``'s ``values`` into ``dst``; integers that do not fit the wire dtype fail (no wrap-around)."""
    a = np.asarray(values)
    if a.shape != dst.shape:
        raise ValueError(f"RLBatch field {f.name}: sample {i} has shape {a.shape}, its header says {dst.shape}")
    if a.size and a.dtype != dst.dtype and a.dtype.kind in "iu":
        lim = np.iinfo(dst.dtype)
        lo, hi = int(a.min()), int(a.max())
        if lo < lim.min or hi > lim.max:
            raise ValueError(f"RLBatch field {f.name}: sample {i} holds {hi if hi > lim.max else lo}, outside "
                             f"{f.dtype}")
    dst[...] = a


def encode(batch: RLBatch, header: Header, share: range, out: np.ndarray | None = None) -> np.ndarray:
    """``share``'s samples of ``batch`` as one uint8 buffer (into ``out`` when given, of ``layout``'s size)."""
    segments, size = layout(header, share)
    buf = np.zeros(size, np.uint8) if out is None else out
    if buf.shape != (size,) or buf.dtype != np.uint8:
        raise ValueError(f"encode: the output buffer is {buf.dtype} {buf.shape}, the share needs uint8 ({size},)")
    for f, offset, rows in segments:
        view, at, take = _typed(buf, f, offset, rows), 0, _SOURCES[f.name]
        for i in share:
            _put(view[at:at + f.rows[i]], take(batch, i), f, i)
            at += f.rows[i]
    return buf


def _split(flat: list, sizes: list[int]) -> list[list]:
    out, at = [], 0
    for n in sizes:
        out.append(flat[at:at + n])
        at += n
    return out


def decode(header: Header, share: range, buf: np.ndarray) -> RLBatch:
    """The ``RLBatch`` of ``share``'s samples from their buffer: lists as the batch held them, routes as
    arrays of their own dtype (views of ``buf``)."""
    segments, size = layout(header, share)
    if buf.shape != (size,):
        raise ValueError(f"decode: a buffer of {buf.shape} bytes for a share of {size}")
    arrays = {f.name: _typed(buf, f, offset, rows) for f, offset, rows in segments}
    sizes = {f.name: [f.rows[i] for i in share] for f in header.fields}

    def lists(name: str) -> list[list] | None:
        return _split(arrays[name].tolist(), sizes[name]) if name in arrays else None

    routes = None
    if "routes" in arrays:
        bounds = np.cumsum([0] + sizes["routes"])
        routes = [arrays["routes"][a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    support = None
    if "support_counts" in arrays:
        ids = lists("support_ids")
        support = [_split(s, c) for s, c in zip(ids, lists("support_counts"))]
    return RLBatch(tokens=lists("tokens"), prompt_lens=header.prompt_lens[share.start:share.stop],
                   behav_logp=lists("behav_logp"), advantages=header.advantages[share.start:share.stop],
                   routes=routes, support=support, support_log_mass=lists("support_log_mass"),
                   loss_mask=lists("loss_mask"), versions=lists("versions"),
                   token_advantages=lists("token_advantages"), ref_logp=lists("ref_logp"), whole=header.whole,
                   first=share.start)


def share_of(batch: RLBatch, header: Header, share: range) -> RLBatch:
    """``share``'s samples of the whole ``batch`` without copying them (rank 0's own share)."""
    def cut(values):
        return None if values is None else values[share.start:share.stop]

    return RLBatch(tokens=cut(batch.tokens), prompt_lens=cut(batch.prompt_lens), behav_logp=cut(batch.behav_logp),
                   advantages=cut(batch.advantages), routes=cut(batch.routes), support=cut(batch.support),
                   support_log_mass=cut(batch.support_log_mass), loss_mask=cut(batch.loss_mask),
                   versions=cut(batch.versions), token_advantages=cut(batch.token_advantages),
                   ref_logp=cut(batch.ref_logp), whole=header.whole,
                   first=share.start)


class BatchScatter:
    """Delivers rank ``src``'s batch over ``group``: each rank its DP rank's share. Constructing it is a
    collective (the source learns every rank's DP rank)."""

    def __init__(self, *, dp_rank: int, dp_size: int, group: dist.ProcessGroup, src: int = 0):
        self.group, self.src, self.dp_rank, self.dp_size = group, src, dp_rank, dp_size
        self.rank = dist.get_rank()
        self.world = dist.get_world_size(group)
        self.device = torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend(group) == "nccl" else torch.device("cpu")
        self.timeout = group_timeout(group)
        self.dp_of: dict[int, int] = {self.rank: dp_rank}
        if self.world > 1:
            everyone: list = [None] * self.world
            with named("the gather of every rank's DP rank for batch delivery", group=group):
                dist.all_gather_object(everyone, (self.rank, dp_rank, dp_size), group=group)
            if {d for _, _, d in everyone} != {dp_size} or {r for _, r, _ in everyone} != set(range(dp_size)):
                raise ValueError(f"batch delivery: the ranks' (rank, dp rank, dp size) do not form one DP layout: "
                                 f"{everyone}")
            self.dp_of = {w: r for w, r, _ in everyone}

    def deliver(self, item: tuple[RLBatch, float, dict] | None, what: str = "a batch") -> tuple[RLBatch, float, dict]:
        """``(batch, normalizer, info)`` given on the source (None elsewhere) -> ``(this DP rank's share,
        normalizer, info)`` on every rank. A one-rank world returns ``item`` as it is."""
        if self.world == 1:
            return item
        box = [None]
        if self.rank == self.src:
            batch, normalizer, info = item
            box = [make_header(batch, normalizer, info, self.dp_size)]
        with named(f"broadcast of the header of {what}", src=self.src, group=self.group):
            dist.broadcast_object_list(box, src=self.src, group=self.group)
        header: Header = box[0]
        share = dp_share(len(header.whole.lengths), self.dp_size, self.dp_rank)
        if self.rank == self.src:
            self._send(batch, header, what)
            return share_of(batch, header, share), header.normalizer, header.info
        _, size = layout(header, share)
        buf = torch.empty(size, dtype=torch.uint8, device=self.device)
        if size:
            with named(f"receive of {what} (DP rank {self.dp_rank}'s share)", src=self.src, group=self.group):
                self._wait(dist.irecv(buf, src=self.src, group=self.group))
        return decode(header, share, buf.cpu().numpy()), header.normalizer, header.info

    def _send(self, batch: RLBatch, header: Header, what: str) -> None:
        """Each DP rank's share encoded once and sent to each of its ranks; all sends in flight together."""
        pending, keep = [], []
        with named(f"send of {what} to the other ranks", group=self.group):
            for d in range(self.dp_size):
                dests = [w for w, r in sorted(self.dp_of.items()) if r == d and w != self.src]
                share = dp_share(len(batch), self.dp_size, d)
                _, size = layout(header, share)
                if not dests or not size:
                    continue
                host = torch.empty(size, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
                encode(batch, header, share, out=host.numpy())
                buf = host.to(self.device, non_blocking=True) if self.device.type == "cuda" else host
                keep += [host, buf]  # alive until every send is done
                pending += [dist.isend(buf, dst=w, group=self.group) for w in dests]
            for work in pending:
                self._wait(work)

    def _wait(self, work) -> None:
        if self.timeout is None:
            work.wait()
        else:
            work.wait(timeout=timedelta(seconds=self.timeout))

