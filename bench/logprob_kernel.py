"""Token logprobs of one micro-batch on a GPU: Transformer Engine's fused cross-entropy kernel
(``train.fused_logprob``, the default where TE is installed) against mrl's fp32 path, forward + backward of
``vocab_parallel_token_logprobs`` on bf16 logits of the RL step's shape (Qwen3's 151,936-word vocabulary,
4 rows of 4,096 tokens). Both paths must agree (max |logprob diff|, max |grad diff| are reported and
checked); then the time of each (median of ``--reps`` after ``--warmup``, CUDA events, the paths
alternating) and the peak memory each adds over the logits.

    python3 bench/logprob_kernel.py --json out.json [--rows 4 --seq 4096 --vocab 151936]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _bench_common import environment  # noqa: E402
from mrl.megatron.forward import vocab_parallel_token_logprobs  # noqa: E402
from mrl.megatron.parallel import GroupInfo  # noqa: E402


def run(logits: torch.Tensor, ids: torch.Tensor, upstream: torch.Tensor, fused: bool):
    """(logprobs, grad, seconds, peak bytes over the start) of one forward + backward."""
    x = logits.clone().requires_grad_(True)  # the fused path writes its gradient into x's buffer
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    lp = vocab_parallel_token_logprobs(x, ids, logits.shape[-1], GroupInfo(None, 0, 1), fused=fused)
    (lp * upstream).sum().backward()
    end.record()
    torch.cuda.synchronize()
    return lp.detach(), x.grad, start.elapsed_time(end) / 1e3, torch.cuda.max_memory_allocated() - base


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from mrl._compat.te import parallel_cross_entropy

    if not torch.cuda.is_available() or parallel_cross_entropy() is None:
        raise SystemExit("bench/logprob_kernel.py needs a GPU with Transformer Engine (TE's fused cross entropy)")
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(a.rows, a.seq, a.vocab, device="cuda", generator=g) * 4).to(torch.bfloat16)
    ids = torch.randint(0, a.vocab, (a.rows, a.seq), device="cuda", generator=g)
    upstream = torch.randn(a.rows, a.seq - 1, device="cuda", generator=g)
    ref_lp, ref_grad, _, _ = run(logits, ids, upstream, fused=False)
    lp, grad, _, _ = run(logits, ids, upstream, fused=True)
    diff = {"lp_max_abs_diff": float((lp - ref_lp).abs().max()),
            "grad_max_abs_diff": float((grad.float() - ref_grad.float()).abs().max()),
            "grad_max_abs": float(ref_grad.float().abs().max())}
    del ref_lp, ref_grad, lp, grad
    times: dict[str, list[float]] = {"fused": [], "fp32": []}
    peaks: dict[str, int] = {}
    for i in range(a.warmup + a.reps):
        for name in (("fused", "fp32") if i % 2 == 0 else ("fp32", "fused")):
            *_, dt, peak = run(logits, ids, upstream, fused=name == "fused")
            if i >= a.warmup:
                times[name].append(dt)
                peaks[name] = max(peaks.get(name, 0), peak)
    res = {"bench": "logprob_kernel", "environment": environment(), "shape": [a.rows, a.seq, a.vocab],
           **diff, "seconds": times,
           "median_s": {k: statistics.median(v) for k, v in times.items()},
           "peak_gib_over_logits": {k: v / 2**30 for k, v in peaks.items()}}
    res["fp32_vs_fused_time"] = res["median_s"]["fp32"] / res["median_s"]["fused"]
    print(json.dumps({k: v for k, v in res.items() if k not in ("environment", "seconds")}, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    # fp32 arithmetic on the same bf16 logits: logprobs to fp32 rounding, gradients to bf16's
    ok = diff["lp_max_abs_diff"] < 1e-3 and diff["grad_max_abs_diff"] <= 1e-2 * max(diff["grad_max_abs"], 1.0)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
