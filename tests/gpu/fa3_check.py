"""FA3 (sgl_kernel.flash_ops) against torch's SDPA on the GPU, at the 30B-A3B slice's attention shape (32 query
heads, 4 KV heads, head dim 128, bf16): a causal variable-length prefill and a paged decode step (page size 1,
as SGLang's KV pool). Run with CUDA_LAUNCH_BLOCKING=1 so a kernel fault is reported at the kernel that made it,
not at a later cuBLAS call: python3 -m tests.gpu.fa3_check [--out fa3_check.json]."""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

HQ, HKV, D = 32, 4, 128


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """[tokens, heads, dim] in, SDPA in float32 with the KV heads repeated for GQA."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    q, k, v = (t.float().transpose(0, 1) for t in (q, k, v))
    if causal and q.shape[1] != k.shape[1]:  # decode: the new token sees everything before it
        causal = False
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(0, 1)


def prefill(lens: list[int]) -> float:
    from sgl_kernel.flash_attn import flash_attn_varlen_func

    n = sum(lens)
    q, k, v = (torch.randn(n, h, D, device="cuda", dtype=torch.bfloat16) for h in (HQ, HKV, HKV))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    out = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    torch.cuda.synchronize()
    err = 0.0
    for i, L in enumerate(lens):
        s = slice(int(cu[i]), int(cu[i]) + L)
        err = max(err, (out[s].float() - reference(q[s], k[s], v[s], True)).abs().max().item())
    return err


def decode(lens: list[int], pool: int = 65536) -> float:
    from sgl_kernel.flash_attn import flash_attn_with_kvcache

    kc, vc = (torch.randn(pool, 1, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    b = len(lens)
    table = torch.zeros(b, max(lens), device="cuda", dtype=torch.int32)
    slots = torch.randperm(pool - 1, device="cuda")[:sum(lens)].int() + 1
    o = 0
    for i, L in enumerate(lens):
        table[i, :L] = slots[o:o + L]
        o += L
    q = torch.randn(b, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
    seqlens = torch.tensor(lens, device="cuda", dtype=torch.int32)
    out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, page_table=table, causal=True)
    torch.cuda.synchronize()
    err = 0.0
    for i, L in enumerate(lens):
        idx = table[i, :L].long()
        ref = reference(q[i], kc[idx, 0], vc[idx, 0], True)
        err = max(err, (out[i].float() - ref).abs().max().item())
    return err


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for name, fn, lens in (("prefill", prefill, [4, 100, 256, 1000]), ("decode", decode, [1, 17, 300, 767])):
        try:
            res[f"{name}_max_abs_err"] = fn(lens)
        except Exception as e:  # the point is which one fails and how
            res[f"{name}_error"] = f"{type(e).__name__}: {e}"[:2000]
    res["ok"] = all(res.get(f"{n}_max_abs_err", 1.0) < 2e-2 for n in ("prefill", "decode"))
    print(json.dumps(res, indent=1))
    if a.out:
        json.dump(res, open(a.out, "w"), indent=1)
    raise SystemExit(0 if res["ok"] else 1)


if __name__ == "__main__":
    main()
