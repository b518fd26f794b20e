"""Block-wise FP8 quantizer (mrl.quant.fp8) against a float64 reference: scales, per-element error bounds,
edge blocks, all-zero blocks, round trip, determinism, the expert-stack path; the triton kernel's indexing
under triton's interpreter. Bit-for-bit triton vs torch runs on GPUs: tests/gpu/fp8_quant.sh."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from mrl.quant.fp8 import Fp8BackendUnavailable, quantize_block_fp8, quantize_block_fp8_torch
from mrl.quant.fp8_format import E4M3_MAX, SCALE_FLOOR, scale_shape
from tests.unit.fp8_reference import dequantize_block_fp8, error_bound, reference_quantize, round_e4m3

SHAPES = [(128, 128), (256, 384), (300, 200), (1, 1), (5, 130), (129, 127), (64, 1000)]


def _weight(shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.02
    # a few outliers, as trained weights have, so that blocks differ in scale
    w.view(-1)[torch.randint(0, w.numel(), (max(1, w.numel() // 500),), generator=g)] *= 40
    return w.to(dtype)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_against_float64_reference(shape, dtype):
    w = _weight(shape, dtype)
    q, s = quantize_block_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.float32 and tuple(s.shape) == scale_shape(shape)
    q_ref, s_ref, x = reference_quantize(w)
    # amax is exact in fp32 and fp32(amax64 / 448) is fp32's correctly rounded division: equal scales
    assert torch.equal(s.to(torch.float64), s_ref.to(torch.float32).to(torch.float64))
    err = (w.to(torch.float64) - dequantize_block_fp8(q, s).to(torch.float64)).abs()
    assert (err <= error_bound(w, s)).all(), f"max excess {(err - error_bound(w, s)).max().item():.3e}"
    # elements whose code differs from float64 rounding can only be the ones fp32's division moved across
    # a rounding tie (none in practice; a wrong rounding mode would show on thousands)
    differ = q.to(torch.float64) != q_ref
    assert differ.sum() <= max(1, w.numel() // 10_000)


def test_the_bound_is_tight_enough_to_catch_a_wrong_rounding():
    """Truncation instead of round-to-nearest breaks the bound: the test above can fail."""
    w = _weight((256, 256), torch.float32)
    q, s = quantize_block_fp8(w)
    x = w.to(torch.float64) / s.to(torch.float64).repeat_interleave(128, 0).repeat_interleave(128, 1)
    trunc = torch.sign(x) * (round_e4m3(x.abs()) - (round_e4m3(x.abs()) > x.abs()).double()
                             * 0.125 * round_e4m3(x.abs()).clamp(min=2.0 ** -6))
    err = (w.to(torch.float64) - trunc * s.to(torch.float64).repeat_interleave(128, 0).repeat_interleave(128, 1))
    assert (err.abs() > error_bound(w, s)).any()


def test_scale_layout_for_partial_blocks():
    """Edge blocks hold what is left of the tensor; their amax is over their own elements only."""
    w = torch.zeros(129, 257)
    w[128, 0] = 3.0      # the single row of block row 1
    w[0, 256] = -5.0     # the single column of block column 2
    w[5, 130] = 0.5      # block (0, 1)
    q, s = quantize_block_fp8(w)
    assert s.shape == (2, 3)
    assert s[1, 0] == torch.tensor(3.0) / E4M3_MAX and s[0, 2] == torch.tensor(5.0) / E4M3_MAX
    assert s[0, 1] == torch.tensor(0.5) / E4M3_MAX
    assert s[0, 0] == SCALE_FLOOR and s[1, 1] == SCALE_FLOOR and s[1, 2] == SCALE_FLOOR
    assert q[128, 0].float() == E4M3_MAX and q[0, 256].float() == -E4M3_MAX and q[5, 130].float() == E4M3_MAX
    assert torch.equal(dequantize_block_fp8(q, s), w)  # every value here is amax of its block: exact


def test_all_zero_blocks():
    w = _weight((256, 256), torch.float32)
    w[:128, 128:] = 0
    q, s = quantize_block_fp8(w)
    assert s[0, 1] == SCALE_FLOOR and s[0, 1] > 0
    assert (q[:128, 128:].float() == 0).all()
    assert torch.isfinite(s).all() and torch.isfinite(q.float()).all()
    assert (dequantize_block_fp8(q, s)[:128, 128:] == 0).all()
    q0, s0 = quantize_block_fp8(torch.zeros(3, 130, 10))
    assert (s0 == SCALE_FLOOR).all() and (q0.float() == 0).all()


def test_tiny_blocks_keep_their_own_scale():
    """A block of tiny (not zero) weights is scaled by its own amax: no floor flattens it."""
    w = _weight((128, 128), torch.float32) * 1e-6
    q, s = quantize_block_fp8(w)
    assert s[0, 0] == w.abs().max() / E4M3_MAX
    assert q.float().abs().max() == E4M3_MAX


def test_round_trip_is_a_fixed_point():
    """Dequantized weights quantize back to the same codes and scales (what a re-export or a sync of
    weights that went through FP8 once gives)."""
    w = _weight((300, 200))
    q, s = quantize_block_fp8(w)
    q2, s2 = quantize_block_fp8(dequantize_block_fp8(q, s))
    assert torch.equal(s2, s)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8))


def test_deterministic():
    w = _weight((3, 200, 300))
    a, b = quantize_block_fp8(w), quantize_block_fp8(w.clone())
    assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])


def test_expert_stack_equals_per_expert_calls():
    w = _weight((4, 130, 260))
    q, s = quantize_block_fp8(w)
    assert q.shape == w.shape and s.shape == (4, 2, 3)
    for e in range(4):
        qe, se = quantize_block_fp8(w[e])
        assert torch.equal(q[e].view(torch.uint8), qe.view(torch.uint8)) and torch.equal(s[e], se)


def test_strided_input():
    """A transposed or sliced weight (not contiguous) quantizes as its contiguous copy."""
    w = _weight((260, 300)).t()
    a, b = quantize_block_fp8(w), quantize_block_fp8(w.contiguous())
    assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])


def test_other_block_sizes():
    w = _weight((100, 70), torch.float32)
    q, s = quantize_block_fp8(w, (64, 32))
    assert s.shape == (2, 3)
    err = (w.double() - dequantize_block_fp8(q, s, (64, 32)).double()).abs()
    assert (err <= error_bound(w, s, (64, 32))).all()


def test_bad_input_is_named():
    with pytest.raises(ValueError, match=r"\[N, K\] weights or \[E, N, K\]"):
        quantize_block_fp8(torch.zeros(4))
    with pytest.raises(ValueError, match="float32/bfloat16/float16"):
        quantize_block_fp8(torch.zeros(4, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="backend must be one of"):
        quantize_block_fp8(torch.zeros(4, 4), backend="cuda")
    with pytest.raises(ValueError, match="does not fit a weight"):
        dequantize_block_fp8(torch.zeros(4, 4, dtype=torch.float8_e4m3fn), torch.ones(2, 2))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA; GPUs run the kernel")
def test_triton_backend_without_cuda_is_a_clear_error():
    with pytest.raises(Fp8BackendUnavailable, match="runs on CUDA tensors.*backend='torch'"):
        quantize_block_fp8(torch.zeros(4, 4), backend="triton")
    q, s = quantize_block_fp8(torch.ones(4, 4), backend="auto")  # auto on CPU: the torch path
    assert s.item() == (torch.tensor(1.0) / E4M3_MAX).item()


def test_triton_kernel_indexing_under_the_interpreter():
    """The kernel's grid, masks and strides, run by triton's CPU interpreter: scales equal the torch path's
    bit for bit. Its codes are not compared: the interpreter emulates the fp8 cast in numpy with another
    rounding than the GPU's cvt.rn (tests/gpu/fp8_quant.sh compares those on a GPU)."""
    pytest.importorskip("triton")
    code = (
        "import torch\n"
        "from mrl.quant.fp8 import quantize_block_fp8_torch\n"
        "from mrl.quant.fp8_triton import quantize_block_fp8_triton\n"
        "torch.manual_seed(0)\n"
        "for shape in [(300, 200), (3, 130, 260), (1, 1)]:\n"
        "    w = torch.randn(shape, dtype=torch.bfloat16)\n"
        "    w[..., :1, :1] = 0\n"
        "    for x in (w, w.transpose(-1, -2)):\n"
        "        q0, s0 = quantize_block_fp8_torch(x)\n"
        "        q1, s1 = quantize_block_fp8_triton(x, (128, 128))\n"
        "        assert torch.equal(s0, s1), (shape, s0, s1)\n"
        "        assert q1.shape == x.shape and q1.dtype == torch.float8_e4m3fn\n"
        "        assert torch.equal(q0.float() == 0, q1.float() == 0), shape\n"
        "print('ok')\n")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the triton kernel runs on GPUs only "
                    "(tests/gpu/fp8_quant.sh runs this on a GPU machine)")
@pytest.mark.parametrize("shape", [(128, 128), (300, 200), (4, 768, 2048), (2, 130, 260), (4096, 2048)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_equals_torch_bit_for_bit(shape, dtype):
    w = _weight(shape, dtype).cuda()
    q0, s0 = quantize_block_fp8_torch(w)
    q1, s1 = quantize_block_fp8(w, backend="triton")
    assert torch.equal(s0, s1)
    assert torch.equal(q0.view(torch.uint8), q1.view(torch.uint8))
    qc, sc = quantize_block_fp8_torch(w.cpu())  # and the same bits as the CPU reference path
    assert torch.equal(sc, s1.cpu()) and torch.equal(qc.view(torch.uint8), q1.cpu().view(torch.uint8))


def test_into_given_tensors():
    w = _weight((2, 130, 260))
    q, s = quantize_block_fp8(w)
    qo = torch.empty(2, 130, 300, dtype=torch.float8_e4m3fn)[..., :260]  # strided views, as in a send buffer
    so = torch.empty(2, 2, 5)[..., :3]
    out = quantize_block_fp8(w, out=(qo, so))
    assert out[0] is qo and torch.equal(qo.view(torch.uint8), q.view(torch.uint8)) and torch.equal(so, s)
    with pytest.raises(ValueError, match="out: expected float8_e4m3fn"):
        quantize_block_fp8(w, out=(qo, torch.empty(2, 2, 2)))
