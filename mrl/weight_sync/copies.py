"""Batched copies for the weight sync's static copy plans (``mrl.weight_sync.copy_plan``): many
``dst.copy_(src)`` pairs run as a few multi-tensor calls, contiguous ranges merged while both sides
continue, and evenly spaced strided copies (one tensor of every expert of a bucket) merged into one
copy with a leading dim."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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


class Flat1D:
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


class Strided:
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
