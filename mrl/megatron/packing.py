"""Sequence packing: several samples per row (first-fit decreasing), and the token layouts around it.

    bins = first_fit_decreasing(slot_lengths, capacity=row_len)
    pk = Packing.build(lengths, bins, row_len=row_len, num_rows=2, fmt="mask")
    ids = pk.pack_tokens(ids_nT, fill=0)                  # [b, S] packed rows
    mb = MicroBatch(ids, routes=pk.pack_tokens(routes_nTLK, fill=pad_ids), packing=pk, ...)
    logprobs_nT = pk.unpack_predictions(logprobs_grid)    # back to one row per sample

Two attention paths behind one interface (``Packing.fmt``):

- ``"mask"``: megatron's local spec (no Transformer Engine; what runs on CPU here). Packed rows
  ``[b, S]`` and a block-diagonal causal ``attention_mask`` ``[b, 1, S, S]`` (bool, True = masked,
  megatron's convention). The local ``DotProductAttention`` keeps its causal mask type and
  ``FusedScaleMaskSoftmax.forward_torch_softmax`` applies a passed mask as given (it builds the
  causal one only when the mask is None). RoPE is computed over row positions ``0..S-1``, not per
  sample, but q.k under RoPE depends only on relative positions and a token attends only inside its
  own sample, so a packed sample equals the unpacked one up to float rounding.
- ``"thd"``: megatron's Transformer Engine spec. All rows of a micro-batch form one ``[1, b*S]``
  sequence with ``PackedSeqParams(qkv_format="thd", cu_seqlens...)``; TE's attention and fused RoPE
  restart at each boundary. The local attention rejects ``packed_seq_params``, and TE's attention
  with a causal mask type ignores a custom mask, so each spec gets exactly one format. Written to
  megatron 0.19.2 / TE's THD contract; it trains on GPUs (the RL-step benchmarks run it), but its
  logprobs have not been compared with unpacked rows under TE. Refused with a clear error without TE.

Each sample occupies a slot of ``align``-rounded length (``2 * cp`` for THD under context parallelism:
TE splits every sequence into ``2 * cp`` chunks); a row's unused tail is one more (dummy) segment.
Positions that belong to no sample's real tokens get the caller's fill values (token 0, valid
expert ids, loss mask 0). Shape legend: n samples, T the longest of them, b rows, S row length.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Literal, Sequence

import torch

from mrl._compat.te import HAVE_TE
from mrl.megatron.compat import to_device

PackFormat = Literal["mask", "thd"]


class PackingError(ValueError):
    pass


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of indices into ``lengths``, each summing to at most ``capacity``: longest first, each into
    the first bin it fits (ties keep input order, so the plan is deterministic on every rank)."""
    if any(n > capacity for n in lengths):
        raise PackingError(f"a sample of {max(lengths)} tokens does not fit a packed row of {capacity}")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        j = next((j for j, r in enumerate(room) if r >= lengths[i]), None)
        if j is None:
            bins.append([])
            room.append(capacity)
            j = len(bins) - 1
        bins[j].append(i)
        room[j] -= lengths[i]
    return bins


def split_rows(num_rows: int, num_micro_batches: int) -> list[int]:
    """Rows per micro-batch, as even as possible (sizes differ by at most one), largest first."""
    base, extra = divmod(num_rows, num_micro_batches)
    return [base + (j < extra) for j in range(num_micro_batches)]


@dataclass
class Packing:
    """Where each sample of one micro-batch sits in its packed rows (sample order = the caller's)."""

    fmt: PackFormat
    num_rows: int
    row_len: int
    row: list[int]
    """Row of each sample."""
    offset: list[int]
    """First position of each sample in its row."""
    length: list[int]
    """Real tokens of each sample."""
    slot: list[int]
    """Positions reserved for each sample (``length`` rounded up to the alignment)."""
    attention_mask: torch.Tensor | None = None
    """``[b, 1, S, S]`` bool, True = masked (``"mask"`` format)."""
    packed_seq_params: object | None = None
    """megatron ``PackedSeqParams`` (``"thd"`` format)."""
    position_ids: torch.Tensor | None = None
    """Per-sample positions (restart at 0 in every sample), in the input grid's shape."""
    cu_seqlens_padded: torch.Tensor | None = None
    """Segment boundaries of the flat ``[b*S]`` token order (samples' slots and row tails), int32."""
    _token_index: torch.Tensor | None = field(default=None, repr=False)
    _prediction_index_on_device: torch.Tensor | None = field(default=None, repr=False)

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def build(cls, lengths: Sequence[int], bins: Sequence[Sequence[int]], *, row_len: int,
              num_rows: int | None = None, fmt: PackFormat = "mask", align: int = 1,
              device: torch.device | str | None = None) -> "Packing":
        """``bins[r]`` = indices into ``lengths`` placed in row r, in order; ``num_rows`` pads with empty
        rows (every micro-batch of a step must share one shape)."""
        num_rows = len(bins) if num_rows is None else num_rows
        if num_rows < len(bins):
            raise PackingError(f"{len(bins)} rows do not fit num_rows={num_rows}")
        if row_len % align:
            raise PackingError(f"row length {row_len} is not a multiple of the slot alignment {align}")
        n = len(lengths)
        row, offset, slot = [-1] * n, [-1] * n, [round_up(int(x), align) for x in lengths]
        for r, b in enumerate(bins):
            pos = 0
            for i in b:
                row[i], offset[i] = r, pos
                pos += slot[i]
            if pos > row_len:
                raise PackingError(f"row {r} holds {pos} positions, more than the row length {row_len}")
        if -1 in row:
            raise PackingError(f"sample {row.index(-1)} is in no bin")
        pk = cls(fmt=fmt, num_rows=num_rows, row_len=row_len, row=row, offset=offset,
                 length=[int(x) for x in lengths], slot=slot)
        pk._finish(torch.device(device) if device is not None else torch.device("cpu"))
        return pk

    def segments(self) -> list[tuple[int, int, int]]:
        """Flat ``(start, slot, real tokens)`` of every segment in ``b * S`` order: the samples' slots
        and each row's unused tail (a dummy segment; a whole empty row is one)."""
        out = []
        for r in range(self.num_rows):
            at = 0
            for off, i in sorted((self.offset[i], i) for i in range(len(self.row)) if self.row[i] == r):
                out.append((r * self.row_len + off, self.slot[i], self.length[i]))
                at = off + self.slot[i]
            if at < self.row_len:
                out.append((r * self.row_len + at, self.row_len - at, self.row_len - at))
        return out

    def _finish(self, device: torch.device) -> None:
        b, s = self.num_rows, self.row_len
        segs = self.segments()
        block = torch.empty(b * s, dtype=torch.long)  # segment of each position
        pos = torch.empty(b * s, dtype=torch.long)
        for j, (start, slot, _) in enumerate(segs):
            block[start:start + slot] = j
            pos[start:start + slot] = torch.arange(slot)
        ends = [0] + [st + sl for st, sl, _ in segs]
        self.cu_seqlens_padded = to_device(torch.tensor(ends, dtype=torch.int32), device)
        if self.fmt == "mask":
            block = block.view(b, s)
            allowed = (block[:, :, None] == block[:, None, :]) & torch.ones(s, s, dtype=torch.bool).tril()
            self.attention_mask = to_device((~allowed).unsqueeze(1), device)
            self.position_ids = to_device(pos.view(b, s), device)
        elif self.fmt == "thd":
            self.packed_seq_params = self._thd_params(segs, device)
            self.position_ids = to_device(pos.view(1, -1), device)
        else:
            raise PackingError(f"packing format must be 'mask' or 'thd', got {self.fmt!r}")
        # the loss unpacks logprobs with it inside megatron's schedule: copied now, not there
        self._prediction_index_on_device = to_device(self._prediction_index(), device)

    def _thd_params(self, segs: list[tuple[int, int, int]], device: torch.device):
        """Transformer Engine path (GPUs; megatron's local attention refuses packed sequences), to megatron
        0.19.2's PackedSeqParams / TE's THD contract: ``cu_seqlens_q`` counts real tokens,
        ``cu_seqlens_q_padded`` the slots (they differ only when slots are aligned for CP). Both are known
        on the host: comparing them there costs no device sync."""
        if not HAVE_TE:
            raise PackingError("packing format 'thd' needs Transformer Engine attention: megatron's local "
                               "DotProductAttention refuses packed_seq_params. Without TE use the 'mask' format.")
        from megatron.core.packed_seq_params import PackedSeqParams

        padded = self.cu_seqlens_padded
        real_ends = list(itertools.accumulate([n for _, _, n in segs], initial=0))
        same = real_ends == [0] + [st + sl for st, sl, _ in segs]  # the values of cu_seqlens_padded
        real = to_device(torch.tensor(real_ends, dtype=torch.int32), device)
        longest = max(sl for _, sl, _ in segs)
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real,
                               cu_seqlens_q_padded=None if same else padded,
                               cu_seqlens_kv_padded=None if same else padded,
                               max_seqlen_q=longest, max_seqlen_kv=longest,
                               total_tokens=self.num_rows * self.row_len)

    # -- layouts -------------------------------------------------------------------------------
    @property
    def grid(self) -> tuple[int, int]:
        """Shape of the model input: ``[b, S]`` (mask) or ``[1, b*S]`` (thd)."""
        return (self.num_rows, self.row_len) if self.fmt == "mask" else (1, self.num_rows * self.row_len)

    @property
    def width(self) -> int:
        """T: positions of the per-sample layout (the longest sample)."""
        return max(self.length)

    def token_index(self) -> torch.Tensor:
        """``[n, T]`` flat index into the ``b * S`` packed positions of each sample token; -1 past its end."""
        if self._token_index is None:
            t = torch.arange(self.width)
            base = torch.tensor([r * self.row_len + o for r, o in zip(self.row, self.offset)])
            idx = base[:, None] + t
            self._token_index = torch.where(t < torch.tensor(self.length)[:, None], idx, -1)
        return self._token_index

    def _prediction_index(self) -> torch.Tensor:
        """``[n, T-1]`` flat index into the prediction grid ``[B, S'-1]`` (position q predicts q + 1)."""
        tok = self.token_index()[:, :-1]
        grid_b, grid_s = self.grid
        row, col = tok // grid_s, tok % grid_s
        valid = (tok >= 0) & (self.token_index()[:, 1:] >= 0)
        return torch.where(valid, row * (grid_s - 1) + col, -1)

    def pack_tokens(self, x_nT: torch.Tensor, fill) -> torch.Tensor:
        """Per-sample ``[n, T, ...]`` -> input grid ``[B, S', ...]``; positions of no sample get ``fill``."""
        runs = [(r * self.row_len + o, n) for r, o, n in zip(self.row, self.offset, self.length)]
        return self._place(x_nT, runs, self.num_rows * self.row_len, self.grid, fill)

    def pack_predictions(self, x_nT1: torch.Tensor, fill) -> torch.Tensor:
        """Per-sample ``[n, T-1, ...]`` (position t predicts token t + 1) -> prediction grid ``[B, S'-1, ...]``."""
        b, s = self.grid
        runs = []
        for r, o, n in zip(self.row, self.offset, self.length):  # a sample never crosses a grid row
            grid_row, col = divmod(r * self.row_len + o, s)
            runs.append((grid_row * (s - 1) + col, n - 1))
        return self._place(x_nT1, runs, b * (s - 1), (b, s - 1), fill)

    @staticmethod
    def _place(x: torch.Tensor, runs: list[tuple[int, int]], numel: int, shape: tuple[int, int], fill) -> torch.Tensor:
        """Sample i's first ``count`` positions to the flat positions ``start..start + count`` (every sample
        is one contiguous run of the grid: a slice copy each, where an index scatter would build and read
        an index of every position)."""
        tail = x.shape[2:]
        out = torch.as_tensor(fill, dtype=x.dtype, device=x.device).expand(numel, *tail).clone()
        for i, (start, count) in enumerate(runs):
            out[start:start + count] = x[i, :count]
        return out.reshape(*shape, *tail)

    def unpack_predictions(self, pred_grid: torch.Tensor, fill=0) -> torch.Tensor:
        """Prediction grid ``[B, S'-1, ...]`` -> per sample ``[n, T-1, ...]`` (differentiable gather)."""
        idx = self._prediction_index_on_device
        if idx is None or idx.device != pred_grid.device:
            idx = self._prediction_index().to(pred_grid.device)
        flat = pred_grid.reshape(-1, *pred_grid.shape[2:])
        out = flat[idx.clamp(min=0)]
        keep = (idx >= 0).reshape(*idx.shape, *([1] * (out.dim() - 2)))
        return torch.where(keep, out, torch.as_tensor(fill, dtype=out.dtype, device=out.device))


def pack_micro_batches(lengths: Sequence[int], *, dp_size: int, dp_rank: int, row_len: int,
                       rows_per_micro_batch: int, fmt: PackFormat | None = None, align: int = 1,
                       device: torch.device | str | None = None) -> list[tuple[list[int], Packing]]:
    """A step's packing plan for one DP rank: ``(sample indices, Packing)`` per micro-batch.

    Rank r packs samples ``[r * n / dp, (r + 1) * n / dp)`` (first-fit decreasing) into rows of
    ``row_len``, at most ``rows_per_micro_batch`` rows per micro-batch. Every DP rank runs as many
    micro-batches as the rank that needs most (EP all-to-alls run in lockstep across DP ranks): rows
    are spread evenly, and a rank with too few rows splits its fullest ones. ``fmt``: the attention
    path of the model's spec (default: ``"thd"`` with Transformer Engine, else ``"mask"``). ``align``: every
    sample's slot is a multiple of it (``2 * cp`` under context parallelism), and so must ``row_len`` be."""
    n = len(lengths)
    if n % dp_size:
        raise PackingError(f"{n} samples do not split over dp={dp_size}")
    fmt = fmt or ("thd" if HAVE_TE else "mask")
    slots = [round_up(int(x), align) for x in lengths]

    def bins_of(rank: int) -> list[list[int]]:
        lo = rank * n // dp_size
        return [[lo + k for k in b] for b in first_fit_decreasing(slots[lo:(rank + 1) * n // dp_size], row_len)]

    num_mb = max(math.ceil(len(bins_of(q)) / rows_per_micro_batch) for q in range(dp_size))
    bins = bins_of(dp_rank)
    while len(bins) < num_mb:  # every rank has n / dp samples >= num_mb, so some bin holds >= 2
        big = max(range(len(bins)), key=lambda j: len(bins[j]))
        half = len(bins[big]) // 2
        bins[big:big + 1] = [bins[big][:half], bins[big][half:]]
    sizes = split_rows(len(bins), num_mb)
    out, at = [], 0
    for k in sizes:
        rows, at = bins[at:at + k], at + k
        idx = [i for b in rows for i in b]
        pos = {i: j for j, i in enumerate(idx)}
        out.append((idx, Packing.build([lengths[i] for i in idx], [[pos[i] for i in b] for b in rows],
                                       row_len=row_len, num_rows=max(sizes), fmt=fmt, align=align,
                                       device=device)))
    return out

