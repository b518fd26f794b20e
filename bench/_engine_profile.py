"""SGLang's own profiler on a running engine during a workload: ``POST /start_profile`` with ``num_steps``
some time into the workload (after its prefills, so the steps are decode steps), then the torch-profiler
trace the engine writes, summed by what each kernel computes (the MoE, attention, dense GEMMs, sampling,
the rest) per profiled step, with the GPU's busy share of the span the kernels cover.
"""

from __future__ import annotations

import asyncio
import glob
import gzip
import json
import os
import time

# the first category whose words a kernel's name contains (lower case); order matters: a fused-MoE GEMM is
# the MoE's, not a dense GEMM
CATEGORIES = (
    ("moe", ("fused_moe", "moe_", "_moe", "grouped_gemm", "expert")),
    ("attention", ("attn", "attention", "flash", "fmha", "mla")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "wgmma")),
    ("sampling", ("sampl", "topk", "top_k", "argmax", "softmax", "multinomial", "argsort", "sort")),
)


def kernel_category(name: str) -> str:
    low = name.lower()
    return next((cat for cat, words in CATEGORIES if any(w in low for w in words)), "other")


def summarize_trace(path: str, steps: int, top: int = 15) -> dict:
    """Kernel time of a chrome trace (``.json`` or ``.json.gz``) per category and per profiled step; on a
    CPU engine (no kernels) the operators' time instead, which nest, so their sums overcount (it checks
    the path, not the figures). ``busy``: summed kernel time over the span from the first kernel's start to
    the last one's end (overlapping kernels can push it past 1)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f).get("traceEvents", [])
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    what = "kernels"
    if not kernels:
        kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
        what = "cpu_ops"
    by_cat: dict[str, float] = {}
    by_name: dict[str, float] = {}
    for e in kernels:
        us = float(e.get("dur", 0.0))
        by_cat[kernel_category(e.get("name", ""))] = by_cat.get(kernel_category(e.get("name", "")), 0.0) + us
        by_name[e.get("name", "")] = by_name.get(e.get("name", ""), 0.0) + us
    total = sum(by_cat.values())
    span = (max(e["ts"] + e.get("dur", 0.0) for e in kernels) - min(e["ts"] for e in kernels)) if kernels else 0.0
    steps = max(steps, 1)
    return {"events": what, "count": len(kernels), "steps": steps, "total_ms_per_step": total / 1e3 / steps,
            "ms_per_step": {c: v / 1e3 / steps for c, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
            "share": {c: v / total for c, v in by_cat.items()} if total else {},
            "busy": total / span if span else None,
            "top": [(n[:120], v / 1e3 / steps) for n, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]]}


async def start_after(url: str, out_dir: str, steps: int, delay_s: float, cpu: bool) -> None:
    """Ask the engine at ``url`` to profile its next ``steps`` forward steps, ``delay_s`` from now."""
    from mrl.sglang.client import EngineClient

    await asyncio.sleep(delay_s)
    c = EngineClient(url)
    try:
        await c._call("POST", "/start_profile", json={"output_dir": out_dir, "num_steps": steps,
                                                      "activities": ["CPU"] if cpu else ["GPU"]},
                      timeout=60.0, admin=True)
    finally:
        await c.close()


def wait_for_trace(out_dir: str, timeout_s: float = 120.0) -> str:
    """The trace the engine wrote in ``out_dir`` once its profiled steps are done (it writes on stop)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        found = sorted(glob.glob(os.path.join(out_dir, "*.trace.json*")))
        if found:
            size = os.path.getsize(found[0])
            time.sleep(1.0)  # written in one go, but not atomically
            if os.path.getsize(found[0]) == size:
                return found[0]
        time.sleep(0.5)
    raise TimeoutError(f"no profiler trace in {out_dir} after {timeout_s:.0f} s (did the workload run "
                       "the profiled steps?)")
