"""Token logprobs from vocab-parallel logits (``forward.vocab_parallel_token_logprobs``, what the training
step uses instead of gathering ``[b, S, V]`` logits over TP) equal ``token_logprobs`` of the full logits,
values and gradients, padding columns excluded: TP1 in process, TP2 under torchrun (gloo); and the fused
path (TE's cross-entropy kernel on GPUs) is called as its contract asks and gives the same values.

The worker is this file run under torchrun (``python -m tests.distributed.test_vocab_parallel_logprobs``).
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.conftest import run_torchrun

B, S, V_REAL, V_PAD = 3, 17, 250, 256  # 6 padding columns, all on the last TP rank


def _case(dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(B, S, V_PAD, generator=g) * 3).to(dtype)
    logits[..., V_REAL:] = 50.0  # padding columns that would dominate a softmax taken over them
    ids = torch.randint(0, V_REAL, (B, S), generator=g)
    upstream = torch.randn(B, S - 1, generator=g)
    return logits, ids, upstream


def _reference(logits, ids, upstream):
    from mrl.megatron.forward import token_logprobs

    full = logits.detach().clone().requires_grad_(True)
    lp = token_logprobs(full, ids, V_REAL)
    (lp * upstream).sum().backward()
    return lp.detach(), full.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tp1_equals_full_log_softmax(dtype):
    from mrl.megatron.forward import vocab_parallel_token_logprobs
    from mrl.megatron.parallel import GroupInfo

    logits, ids, upstream = _case(dtype)
    want_lp, want_grad = _reference(logits, ids, upstream)
    x = logits.clone().requires_grad_(True)
    lp = vocab_parallel_token_logprobs(x, ids, V_REAL, GroupInfo(None, 0, 1))
    (lp * upstream).sum().backward()
    assert torch.equal(x.detach(), logits)  # the input is left alone (fp32: no in-place on it)
    torch.testing.assert_close(lp, want_lp, rtol=0, atol=1e-5)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(x.grad.float(), want_grad.float(), rtol=0, atol=tol)
    assert x.grad.dtype == dtype and not x.grad[..., V_REAL:].any()


def _kernel_contract(calls: list):
    """What ``forward`` takes from TE's ``parallel_cross_entropy`` (its documented contract: per-row
    -log softmax(inp)[target] in fp32, rows whose target is ``ignore_idx`` give 0 and no gradient),
    written with torch; the real kernel is checked against the fp32 path on a GPU
    (tests/gpu/fused_logprob_check.py)."""
    def ce(inp, target, label_smoothing, reduce_loss, group, ignore_idx, overwrite_input=False):
        calls.append({"shape": tuple(inp.shape), "smoothing": label_smoothing, "reduce": reduce_loss,
                      "group": group, "overwrite": overwrite_input, "last": target[:, -1].tolist()})
        loss = torch.nn.functional.cross_entropy(inp.float().flatten(0, 1), target.flatten(),
                                                 ignore_index=ignore_idx, reduction="none")
        return loss.view(target.shape)
    return ce


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernel_path_equals_the_fp32_path(monkeypatch, dtype):
    """``fused``: the whole logits go to TE's kernel with the targets shifted and the last position
    ignored; logprobs and gradients equal the fp32 path's, and the kernel is asked to reuse the logits'
    buffer. A padded shard, ``fused=False`` or no kernel (CPU) take the fp32 path."""
    from mrl.megatron import forward
    from mrl.megatron.parallel import GroupInfo

    calls: list = []
    monkeypatch.setattr(forward, "_fused_cross_entropy", lambda logits: _kernel_contract(calls))
    logits, ids, upstream = _case(dtype)
    logits = logits[..., :V_REAL].contiguous()  # an unpadded vocabulary
    full = logits.detach().clone().requires_grad_(True)
    want_lp = forward.vocab_parallel_token_logprobs(full, ids, V_REAL, GroupInfo(None, 0, 1), fused=False)
    (want_lp * upstream).sum().backward()
    assert calls == []
    x = logits.clone().requires_grad_(True)
    lp = forward.vocab_parallel_token_logprobs(x, ids, V_REAL, GroupInfo(None, 0, 1))
    (lp * upstream).sum().backward()
    assert calls == [{"shape": (B, S, V_REAL), "smoothing": 0.0, "reduce": False, "group": None,
                      "overwrite": True, "last": [-100] * B}]
    assert lp.shape == (B, S - 1)
    torch.testing.assert_close(lp, want_lp.detach(), rtol=0, atol=1e-5)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(x.grad.float(), full.grad.float(), rtol=0, atol=tol)
    assert not x.grad[:, -1].any()  # the last position predicts nothing

    padded, _, _ = _case(dtype)  # 256 columns for a 250-word vocabulary: padding would enter the softmax
    forward.vocab_parallel_token_logprobs(padded, ids, V_REAL, GroupInfo(None, 0, 1))
    assert len(calls) == 1
    monkeypatch.undo()
    assert forward._fused_cross_entropy(logits) is None  # CPU tensors: never TE's kernel


@pytest.mark.dist
def test_tp2_equals_full_log_softmax(tmp_path):
    out = tmp_path / "tp2.json"
    r = run_torchrun("tests.distributed.test_vocab_parallel_logprobs", ["--out", str(out)], 2, timeout=120)
    assert r.returncode == 0, r.stderr[-4000:]
    rep = json.loads(out.read_text())
    assert rep["lp_max_abs_diff"] < 1e-5 and rep["grad_max_abs_diff"] < 1e-6, rep
    assert rep["padding_grad_zero"], rep


def main() -> None:
    import argparse

    import torch.distributed as dist

    from mrl.megatron.forward import vocab_parallel_token_logprobs
    from mrl.megatron.parallel import GroupInfo

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(ws)))
    logits, ids, upstream = _case(torch.float32)
    want_lp, want_grad = _reference(logits, ids, upstream)
    width = V_PAD // ws
    x = logits[..., rank * width:(rank + 1) * width].clone().requires_grad_(True)
    lp = vocab_parallel_token_logprobs(x, ids, V_REAL, GroupInfo(group, rank, ws))
    (lp * upstream).sum().backward()
    rep = {"lp_max_abs_diff": float((lp - want_lp).abs().max()),
           "grad_max_abs_diff": float((x.grad - want_grad[..., rank * width:(rank + 1) * width]).abs().max()),
           "padding_grad_zero": bool(rank < ws - 1 or not x.grad[..., V_REAL - rank * width:].any())}
    reps = [None] * ws
    dist.all_gather_object(reps, rep)
    if rank == 0:
        worst = {k: max(r[k] for r in reps) for k in ("lp_max_abs_diff", "grad_max_abs_diff")}
        worst["padding_grad_zero"] = all(r["padding_grad_zero"] for r in reps)
        with open(a.out, "w") as f:
            json.dump(worst, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
