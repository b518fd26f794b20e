"""The fused block-FP8 quantizer for CUDA tensors (one program per 128x128 block: load, amax, scale,
divide, cast, store; nothing staged in fp32). Same convention and bits as
``mrl.quant.fp8.quantize_block_fp8_torch``; imported only through ``mrl.quant.fp8.quantize_block_fp8``.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from mrl.quant.fp8_format import AMAX_FLOOR, E4M3_MAX, scale_shape


@triton.jit
def _block_fp8_kernel(x_ptr, q_ptr, s_ptr, N, K, nb_n, nb_k,
                      sx_e, sx_n, sx_k, sq_e, sq_n, sq_k, ss_e, ss_n, ss_k,
                      BN: tl.constexpr, BK: tl.constexpr, FP8_MAX: tl.constexpr, AMAX_MIN: tl.constexpr):
    # a 1-D grid: (experts x row blocks x column blocks) exceeds the 65535 limit of grid axes 1 and 2
    pid = tl.program_id(0).to(tl.int64)
    per_e = nb_n * nb_k
    e = pid // per_e
    bn = (pid % per_e) // nb_k
    bk = pid % nb_k
    rows = bn * BN + tl.arange(0, BN)
    cols = bk * BK + tl.arange(0, BK)
    mask = (rows[:, None] < N) & (cols[None, :] < K)
    x = tl.load(x_ptr + e * sx_e + rows[:, None] * sx_n + cols[None, :] * sx_k, mask=mask, other=0.0)
    x = x.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x)), AMAX_MIN)
    # div_rn: IEEE division as torch does it; triton's "/" is an approximate division on fp32
    scale = tl.math.div_rn(amax, FP8_MAX)
    y = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + e * sq_e + rows[:, None] * sq_n + cols[None, :] * sq_k, y.to(q_ptr.dtype.element_ty),
             mask=mask)
    tl.store(s_ptr + e * ss_e + bn * ss_n + bk * ss_k, scale)


def quantize_block_fp8_triton(w: torch.Tensor, block_size: tuple[int, int],
                              out: tuple[torch.Tensor, torch.Tensor] | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale_inv)`` of a CUDA tensor ``w`` ([N, K] or [E, N, K], any strides), into ``out`` (any
    strides) when given."""
    squeeze = w.dim() == 2
    x = w.unsqueeze(0) if squeeze else w
    e, n, k = x.shape
    bn, bk = block_size
    if out is not None:
        q, s = (t.unsqueeze(0) for t in out) if squeeze else out
    else:
        q = torch.empty((e, n, k), dtype=torch.float8_e4m3fn, device=x.device)
        s = torch.empty(scale_shape((e, n, k), block_size), dtype=torch.float32, device=x.device)
    nb_n, nb_k = s.shape[1], s.shape[2]
    if q.numel():
        # x's device current while launching; a CPU tensor only reaches here under TRITON_INTERPRET=1
        with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
            _block_fp8_kernel[(e * nb_n * nb_k,)](
                x, q, s, n, k, nb_n, nb_k, *x.stride(), *q.stride(), *s.stride(),
                BN=bn, BK=bk, FP8_MAX=E4M3_MAX, AMAX_MIN=AMAX_FLOOR, num_warps=8)
    if out is not None:
        return out
    return (q[0], s[0]) if squeeze else (q, s)
