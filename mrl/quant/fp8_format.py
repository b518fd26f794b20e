"""The block-FP8 (e4m3) format SGLang's ``fp8`` method loads: its constants and the shape of its scales.

Shared by the quantizers (``mrl.quant.fp8``, ``mrl.quant.fp8_triton``) and the weight-sync planner, which sizes
the scales of every FP8 target without touching a tensor; no torch here.
"""

from __future__ import annotations

E4M3_MAX = 448.0
"""Largest finite ``float8_e4m3fn``."""
BLOCK_SIZE = (128, 128)
"""(rows, columns) of one scale block: ``weight_block_size`` of block-FP8 checkpoints (DeepSeek-V3, Qwen3)."""
SCALE_FLOOR = 2.0 ** -126
"""Smallest ``scale_inv``, the smallest normal fp32 (``torch.finfo(torch.float32).tiny``); only blocks whose amax
is under ``448 * SCALE_FLOOR`` (all-zero ones) get it."""
AMAX_FLOOR = E4M3_MAX * SCALE_FLOOR
"""amax floor that gives SCALE_FLOOR exactly (448 * 2^-126 is exact in fp32, and so is its division by 448)."""


def scale_shape(shape: tuple[int, ...], block_size: tuple[int, int] = BLOCK_SIZE) -> tuple[int, ...]:
    """Shape of ``scale_inv`` for a weight (or expert stack) of ``shape``."""
    *lead, n, k = shape
    bn, bk = block_size
    return (*lead, -(-n // bn), -(-k // bk))
