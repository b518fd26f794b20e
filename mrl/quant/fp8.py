"""Block-wise FP8 (e4m3) weight quantization in the layout SGLang's ``fp8`` method loads.

A weight ``w`` of shape ``[N, K]`` becomes ``q`` (``torch.float8_e4m3fn``, same shape) and ``scale_inv``
(fp32, ``[ceil(N / bn), ceil(K / bk)]``, bn = bk = 128 by default): for every block, ``scale_inv = amax /
448`` over the block's elements and ``q = clamp(w / scale_inv, -448, 448)`` rounded to nearest even. The
engine dequantizes ``w ~= q * scale_inv`` per block (SGLang's ``block_quant_dequant``), so ``scale_inv`` is
the dequantization factor, despite its name. Blocks at the right and bottom edges cover what is left of the
tensor (their amax is over their real elements only). An all-zero block gets the smallest normal fp32 as
its ``scale_inv`` and zeros as ``q``: a scale of 0 would make the engine's requantizations (UE8M0 scales on
Blackwell) divide by zero, and a floor this low leaves every block with a nonzero amax at ``amax / 448``.

MoE experts go in one call as an ``[E, N, K]`` stack (scales ``[E, ceil(N / bn), ceil(K / bk)]``).

Two implementations give the same bits: plain torch (any device; the reference, and what CPU runs) and a
fused triton kernel for CUDA tensors (``mrl.quant.fp8_triton``, imported only when asked for and
available). Both divide with IEEE round-to-nearest (no reciprocal multiply) and cast with
round-to-nearest-even, so ``tests/gpu/fp8_quant.sh`` compares them bit for bit.
"""

from __future__ import annotations

import torch

from mrl.quant.fp8_format import AMAX_FLOOR, BLOCK_SIZE, E4M3_MAX, scale_shape

BACKENDS = ("auto", "torch", "triton")


class Fp8BackendUnavailable(RuntimeError):
    pass


def _check(w: torch.Tensor, block_size: tuple[int, int]) -> None:
    if w.dim() not in (2, 3):
        raise ValueError(f"block FP8 quantizes [N, K] weights or [E, N, K] expert stacks, got shape {tuple(w.shape)}")
    if not w.is_floating_point() or w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"block FP8 quantizes float32/bfloat16/float16 weights, got {w.dtype}")
    if len(block_size) != 2 or min(block_size) < 1:
        raise ValueError(f"block_size must be two positive ints, got {block_size}")


def quantize_block_fp8(w: torch.Tensor, block_size: tuple[int, int] = BLOCK_SIZE, backend: str = "auto",
                       out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale_inv)`` of ``w`` ([N, K] or [E, N, K]); see the module docstring for the convention.

    backend: ``torch`` (any device), ``triton`` (CUDA tensors with triton installed; an error names what is
    missing), ``auto`` (triton for a CUDA tensor when triton imports, else torch). out: ``(q, scale_inv)``
    tensors of the right shapes and dtypes to write into, any strides (views of a send buffer: the triton
    kernel writes them directly). Non-finite inputs give non-finite scales: the weight sync refuses such
    weights before it quantizes them."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    block_size = tuple(int(b) for b in block_size)
    _check(w, block_size)
    if out is not None:
        q_out, s_out = out
        if (tuple(q_out.shape) != tuple(w.shape) or q_out.dtype != torch.float8_e4m3fn
                or tuple(s_out.shape) != scale_shape(tuple(w.shape), block_size) or s_out.dtype != torch.float32):
            raise ValueError(f"out: expected float8_e4m3fn {tuple(w.shape)} and float32 "
                             f"{scale_shape(tuple(w.shape), block_size)}, got {q_out.dtype} {tuple(q_out.shape)} "
                             f"and {s_out.dtype} {tuple(s_out.shape)}")
    if backend == "auto":
        backend = "triton" if w.is_cuda and triton_available() else "torch"
    if backend == "triton":
        return _triton_module(w).quantize_block_fp8_triton(w, block_size, out=out)
    q, s = quantize_block_fp8_torch(w, block_size)
    if out is None:
        return q, s
    out[0].copy_(q)
    out[1].copy_(s)
    return out


def triton_available() -> bool:
    """CUDA present and triton importable (what the fused kernel needs)."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _triton_module(w: torch.Tensor):
    if not w.is_cuda:
        raise Fp8BackendUnavailable(f"the triton FP8 quantizer runs on CUDA tensors; this one is on {w.device} "
                                    "(backend='torch' quantizes on any device)")
    try:
        from mrl.quant import fp8_triton
    except ImportError as e:
        raise Fp8BackendUnavailable(f"the triton FP8 quantizer needs triton ({e}); backend='torch' needs "
                                    "nothing") from e
    return fp8_triton


def quantize_block_fp8_torch(w: torch.Tensor, block_size: tuple[int, int] = BLOCK_SIZE
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch implementation (any device): pads to whole blocks with zeros, which leave every amax as
    it is, and drops the padding from ``q``. Holds one fp32 copy of ``w`` (padded)."""
    _check(w, block_size)
    squeeze = w.dim() == 2
    x = w.unsqueeze(0) if squeeze else w
    e, n, k = x.shape
    bn, bk = block_size
    nb, kb = -(-n // bn), -(-k // bk)
    x = x.to(torch.float32)
    if nb * bn != n or kb * bk != k:
        x = torch.nn.functional.pad(x, (0, kb * bk - k, 0, nb * bn - n))
    blocks = x.view(e, nb, bn, kb, bk)
    amax = blocks.abs().amax(dim=(2, 4))
    # a tensor divisor, not a Python number: CUDA turns division by a host scalar into a multiply by its
    # reciprocal, one rounding off the triton kernel's (and the engine's) amax / 448
    fp8_max = torch.tensor(E4M3_MAX, dtype=torch.float32, device=x.device)
    scale_inv = torch.clamp(amax, min=AMAX_FLOOR) / fp8_max
    q = (blocks / scale_inv[:, :, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    q = q.view(e, nb * bn, kb * bk)[:, :n, :k].contiguous()
    return (q[0], scale_inv[0]) if squeeze else (q, scale_inv)
