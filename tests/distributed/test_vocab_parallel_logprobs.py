"""Token logprobs from vocab-parallel logits (``forward.vocab_parallel_token_logprobs``, what the training
step uses instead of gathering ``[b, S, V]`` logits over TP) equal ``token_logprobs`` of the full logits,
values and gradients, padding columns excluded: TP1 in process, TP2 under torchrun (gloo).

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
