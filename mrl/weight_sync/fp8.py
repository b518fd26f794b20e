"""FP8 weight sync: the staging layout of an FP8 bucket and the sender's quantization of a bucket into
SGLang's flat byte layout (the planner itself names each FP8 entry: ``planner.fp8_entries``).

An engine started from a block-FP8 checkpoint (``mrl export-fp8``) takes updates in that checkpoint's
format: each FP8 target (``mrl.quant.fp8_targets``) as its e4m3 weight and its fp32 ``weight_scale_inv``,
both HF-named, which SGLang's loader routes like checkpoint tensors. So an FP8 plan is the bf16 plan with
each target ``HFTensor`` replaced by that pair, inside the same ``PlannedParam`` (same sender, same
bucket); everything else travels in the sync dtype.

The flat buffer of a bucket is what SGLang's ``flattened_bucket`` format decodes (multi-dtype): each
entry's bytes back to back, in entry order, no padding. ``quantize_bucket`` writes it: weights of the same
kind and shape that repeat at a fixed byte stride (every expert's gate_proj in a bucket of whole experts)
are quantized by one call over their stack, written straight into their strided places in the buffer.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace

import torch

from mrl.quant.fp8 import quantize_block_fp8
from mrl.quant.fp8_format import BLOCK_SIZE, scale_shape
from mrl.quant.fp8_targets import is_fp8_target, scale_inv_name
from mrl.weight_sync.planner import FP8_DTYPE, SCALE_DTYPE, Bucket, HFTensor, PlannedParam, fp8_entries

_EXPERT = re.compile(r"\.experts\.\d+\.")


def high_precision(p: PlannedParam, dtype: str) -> PlannedParam:
    """The param as the trainer gathers it before quantizing: each (e4m3 weight, scales) pair back to its
    weight in ``dtype`` (the bf16 layout the sender stages a bucket in); the inverse of ``fp8_param``."""
    out: list[HFTensor] = []
    for t in p.tensors:
        if out and t.dtype == SCALE_DTYPE and out[-1][1] and t.name == scale_inv_name(out[-1][0].name):
            continue
        out.append((HFTensor(t.name, t.shape, dtype) if t.dtype == FP8_DTYPE else t, t.dtype == FP8_DTYPE))
    return replace(p, tensors=tuple(t for t, _ in out))


def has_fp8(bucket: Bucket) -> bool:
    return any(t.dtype == FP8_DTYPE for t in bucket.tensors)


def staged_bucket(bucket: Bucket, dtype: str) -> Bucket:
    """``bucket`` with its params as ``high_precision`` gives them: the layout of its staging buffer."""
    return replace(bucket, params=[high_precision(p, dtype) for p in bucket.params])


class BucketQuantizer:
    """The sender's last step of an FP8 bucket, built once per bucket and run every sync: the staged
    high-precision tensors (views of the staging buffer the copy plan fills) quantized into the bucket's
    flat send buffer. Checks at build time that what it writes is the planned bucket, entry for entry."""

    def __init__(self, bucket: Bucket, staging: torch.Tensor, flat: torch.Tensor, dtype: str,
                 backend: str = "auto"):
        self.tensors = staged_bucket(bucket, dtype).tensors
        # the plan says which targets go in FP8 (engine.fp8_ignore keeps some in high precision): the
        # rule's targets it sends as they are are the ones this quantizer leaves alone
        planned = {e.name for e in bucket.tensors if e.dtype == FP8_DTYPE}
        self.ignored = tuple(t.name.removesuffix(".weight") for t in self.tensors
                             if is_fp8_target(t.name) and t.name not in planned)
        self.views, at = [], 0
        for t in self.tensors:
            n = 1
            for d in t.shape:
                n *= d
            self.views.append(staging[at:at + n].view(t.shape))
            at += n
        entries = [e for t in self.tensors for e in fp8_entries(t, self.ignored)]
        if entries != bucket.tensors:
            raise ValueError(f"bucket {bucket.index} of sender {bucket.sender}: its planned FP8 entries are not what "
                             "quantizing its tensors gives (the plan and the sender disagree on the FP8 targets)")
        self.flat, self.backend = flat, backend

    def __call__(self) -> None:
        quantize_bucket(self.tensors, self.views, ignored=self.ignored, flat=self.flat, backend=self.backend)


def quantize_checkpoint(tensors: dict[str, torch.Tensor], dtype: torch.dtype, backend: str = "auto",
                        ignored: Sequence[str] = ()) -> dict[str, torch.Tensor]:
    """HF-named full tensors as the block-FP8 checkpoint of them (the disk transport's export to FP8
    engines): each target (but the modules ``ignored`` keeps in high precision) cast to ``dtype`` (the sync
    dtype, as the distributed path quantizes it) and quantized, followed by its ``weight_scale_inv``; the
    other tensors as they are."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if t.dim() == 2 and is_fp8_target(name, ignored):
            out[name], out[scale_inv_name(name)] = quantize_block_fp8(t.to(dtype), backend=backend)
        else:
            out[name] = t
    return out


def byte_offsets(entries: Sequence[HFTensor]) -> list[int]:
    """Start of each entry in the flat buffer (back to back, no padding), and the total as the last item."""
    out, at = [], 0
    for e in entries:
        out.append(at)
        at += e.nbytes
    return out + [at]


def quantize_bucket(tensors: Sequence[HFTensor], values: Sequence[torch.Tensor], *, ignored: Sequence[str] = (),
                    block_size: tuple[int, int] = BLOCK_SIZE, flat: torch.Tensor | None = None,
                    backend: str = "auto") -> tuple[list[HFTensor], torch.Tensor]:
    """The FP8 entries of a bucket of high-precision HF tensors (``values[i]`` holds ``tensors[i]``) and the
    uint8 flat buffer they fill (``flat``, else a new one on ``values``' device)."""
    if len(tensors) != len(values):
        raise ValueError(f"{len(tensors)} tensors but {len(values)} values")
    entries: list[HFTensor] = []
    first: list[int] = []  # index in entries of each input's first entry
    for t in tensors:
        first.append(len(entries))
        entries.extend(fp8_entries(t, ignored, block_size))
    offsets = byte_offsets(entries)
    device = values[0].device if values else torch.device("cpu")
    if flat is None:
        flat = torch.empty(offsets[-1], dtype=torch.uint8, device=device)
    if flat.dtype != torch.uint8 or flat.numel() < offsets[-1] or flat.dim() != 1:
        raise ValueError(f"flat: a 1-D uint8 buffer of at least {offsets[-1]} bytes is needed, got {flat.dtype} "
                         f"{tuple(flat.shape)}")
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        if entries[first[i]].dtype == FP8_DTYPE:
            groups.setdefault((_EXPERT.sub(".experts.*.", t.name), t.shape), []).append(i)
        else:
            v = values[i]
            if tuple(v.shape) != tuple(t.shape) or str(v.dtype).removeprefix("torch.") != t.dtype:
                raise ValueError(f"{t.name}: value is {v.dtype} {tuple(v.shape)}, the plan says {t.dtype} {t.shape}")
            flat[offsets[first[i]]:offsets[first[i] + 1]].copy_(v.contiguous().reshape(-1).view(torch.uint8))
    for members in groups.values():
        for run in _strided_runs(members, [offsets[first[i]] for i in members]):
            _quantize_run(run, tensors, values, [offsets[first[i]] for i in run], flat, block_size, backend)
    return entries, flat[:offsets[-1]]


def _strided_runs(members: list[int], starts: list[int]) -> list[list[int]]:
    """Consecutive members whose weights start at a fixed byte stride (a multiple of 4, for the fp32
    scale views), as long runs as possible."""
    runs: list[tuple[list[int], list[int]]] = []
    for m, at in zip(members, starts):
        if runs:
            run, at_run = runs[-1]
            step = at - at_run[-1]
            if step % 4 == 0 and (len(run) == 1 or step == at_run[1] - at_run[0]):
                run.append(m)
                at_run.append(at)
                continue
        runs.append(([m], [at]))
    return [run for run, _ in runs]


def _quantize_run(run: list[int], tensors, values, starts: list[int], flat: torch.Tensor,
                  block_size: tuple[int, int], backend: str) -> None:
    n, k = tensors[run[0]].shape
    sshape = scale_shape((n, k), block_size)
    stride = starts[1] - starts[0] if len(run) > 1 else 0
    q0, s0 = starts[0], starts[0] + n * k
    if s0 % 4 or (flat.data_ptr() % 4):
        raise ValueError(f"{tensors[run[0]].name}: its scales would start at byte {s0} of the buffer, not on a "
                         "4-byte boundary (weights with n * k not a multiple of 4)")
    for i in run:
        v = values[i]
        if tuple(v.shape) != (n, k) or not v.is_floating_point():
            raise ValueError(f"{tensors[i].name}: value is {v.dtype} {tuple(v.shape)}, the plan says {(n, k)}")
    f32 = flat[:flat.numel() // 4 * 4].view(torch.float32)
    e = len(run)
    q = flat.as_strided((e, n, k), (stride, k, 1), flat.storage_offset() + q0).view(torch.float8_e4m3fn)
    s = f32.as_strided((e, *sshape), (stride // 4, sshape[1], 1), f32.storage_offset() + s0 // 4)
    w = values[run[0]].unsqueeze(0) if e == 1 else torch.stack([values[i] for i in run])
    quantize_block_fp8(w, block_size, backend=backend, out=(q, s))
