"""Float64 reference of block-wise FP8 (e4m3) quantization, written from the format's definition (3 mantissa
bits, normals from 2^-6, subnormal step 2^-9, largest finite 448) without torch's float8 cast.
The engine's dequantization (``dequantize_block_fp8``) is here too: only the tests read FP8 weights back."""

from __future__ import annotations

import math

import torch

from mrl.quant.fp8_format import BLOCK_SIZE, scale_shape

E4M3_MAX = 448.0
MIN_NORMAL_EXP = -6
MANTISSA_BITS = 3


def e4m3_ulp(mag: torch.Tensor) -> torch.Tensor:
    """Spacing of e4m3 values in the binade of ``mag`` (>= 0, float64); the subnormal step below 2^-6."""
    mag = mag.to(torch.float64)
    exp = torch.floor(torch.log2(mag.clamp(min=2.0 ** MIN_NORMAL_EXP)))
    return torch.pow(2.0, exp - MANTISSA_BITS)


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round float64 ``x`` to the nearest e4m3 value, ties to even, saturating at +-448."""
    ulp = e4m3_ulp(x.abs())
    return (torch.round(x / ulp) * ulp).clamp(-E4M3_MAX, E4M3_MAX)  # torch.round: half to even


def reference_quantize(w: torch.Tensor, block: tuple[int, int] = (128, 128)):
    """(q as float64 values, scale_inv float64, x = w / scale_inv float64) for a 2-D ``w``."""
    w64 = w.to(torch.float64)
    n, k = w64.shape
    bn, bk = block
    nb, kb = math.ceil(n / bn), math.ceil(k / bk)
    scale = torch.empty(nb, kb, dtype=torch.float64)
    for i in range(nb):
        for j in range(kb):
            amax = w64[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().max()
            scale[i, j] = amax / E4M3_MAX if amax > 0 else torch.finfo(torch.float32).tiny
    full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
    x = w64 / full
    return round_e4m3(x), scale, x


def error_bound(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """Per element: scale_inv x half an e4m3 ulp at |w / scale_inv| (with room for fp32's rounding of the
    division, 2^-24 relative, and of the scale itself)."""
    n, k = w.shape[-2:]
    bn, bk = block
    s = scale_inv.to(torch.float64).repeat_interleave(bn, -2).repeat_interleave(bk, -1)[..., :n, :k]
    x = w.to(torch.float64).abs() / s
    return s * (0.5 * e4m3_ulp(x) + x * 2.0 ** -22)


def dequantize_block_fp8(q: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int] = BLOCK_SIZE,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale_inv`` per block, as the engine reads the weight back (SGLang's ``block_quant_dequant``)."""
    *_, n, k = q.shape
    if tuple(scale_inv.shape) != scale_shape(tuple(q.shape), block_size):
        raise ValueError(f"scale_inv of shape {tuple(scale_inv.shape)} does not fit a weight of shape "
                         f"{tuple(q.shape)} in blocks of {tuple(block_size)}: expected "
                         f"{scale_shape(tuple(q.shape), block_size)}")
    bn, bk = block_size
    s = scale_inv.to(torch.float32).repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)[..., :n, :k]
    return (q.to(torch.float32) * s).to(dtype)
