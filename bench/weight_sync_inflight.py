"""Generation pause per weight sync, by ``weight_sync.pause_mode``: abort against retract, in_place and staged.

    python bench/weight_sync_inflight.py --out DIR                 # one GPU: engine beside the trainer (CUDA IPC)
    python bench/weight_sync_inflight.py --cpu --out DIR           # the same flow on CPU, tiny model (gloo)

One SGLang engine (mrl's, patched) and one trainer rank (``bench/_inflight_worker.py``: megatron model,
``FullWeightChannel``) on the same GPU, so the sync goes over CUDA IPC (``--transport``; ``distributed`` on CPU).
Every sync runs with ``--requests`` greedy requests decoding; the generation pause is what a request sees: its
longest wait for a token around the sync, less one decode step (the worker's docstring says how each mode is
measured). Modes alternate within each repetition, so ``in_place_vs_abort`` is the median of paired ratios.
The report (``bench/reports/weight_sync/<date>_weight_sync_inflight_<hardware>.json``) holds every sync;
``inplace_pause_ms`` is in_place's median over the repetitions with its spread, ``staged_pause_ms`` staged's (the
engine keeps decoding through the push and stops only for the swap; its log's ``mrl: staged weight update`` lines
give each load's seconds and the forward passes it ran meanwhile).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from _bench_common import HERE, device_name, dump, make_model, slug, spread


def summarize(rows: list[dict]) -> dict:
    rows = [r for r in rows if not r["warmup"]]
    modes = sorted({r["mode"] for r in rows})
    out = {"version_errors": sum(r["version_errors"] for r in rows),
           "version_errors_past_launched": sum(r.get("version_errors_past_launched", 0) for r in rows)}
    for mode in modes:
        mine = [r for r in rows if r["mode"] == mode]
        out[mode] = {"generation_pause_ms": spread([r["generation_pause_ms"] for r in mine]),
                     "sync_ms": spread([r["sync_ms"] for r in mine]),
                     "phase_ms": {k: statistics.median(r["phase_ms"][k] for r in mine) for k in mine[0]["phase_ms"]}}
    if "in_place" in out:
        out["inplace_pause_ms"] = out["in_place"]["generation_pause_ms"]
    if "staged" in out:
        out["staged_pause_ms"] = out["staged"]["generation_pause_ms"]
    by_rep: dict[int, dict] = {}
    for i, r in enumerate(rows):
        by_rep.setdefault(i // len(modes), {})[r["mode"]] = r["generation_pause_ms"]
    for mode in ("in_place", "retract", "staged"):
        ratios = [d[mode] / d["abort"] for d in by_rep.values() if mode in d and "abort" in d and d["abort"] > 0]
        if ratios:
            out[f"{mode}_vs_abort_pause"] = spread(ratios) | {"pairs": len(ratios)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cpu", action="store_true", help="CPU engine and trainer, tiny model (checks the flow)")
    ap.add_argument("--model", default="qwen3_30b_a3b_l12", help="a make_model preset (GPU)")
    ap.add_argument("--ckpt-root", default=None, help="where the random checkpoint is made or found (default --out)")
    ap.add_argument("--gpu", default="0", help="the GPU the trainer and the engine share")
    ap.add_argument("--transport", default=None, help="null: tensor on GPU, distributed on CPU")
    ap.add_argument("--mem-fraction", type=float, default=0.45, help="the engine's share of the GPU")
    ap.add_argument("--modes", default=None, help="null: abort,in_place,retract,staged (CPU, whose transport is "
                    "distributed, which staged does not serve: abort,in_place,retract)")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=None, help="each request's budget (null: 1024, CPU 200)")
    ap.add_argument("--before", type=int, default=16)
    ap.add_argument("--after", type=int, default=16)
    ap.add_argument("--report", default=None, help="report path (default: bench/reports/weight_sync/...)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    from mrl.engine.launcher import Engine

    t_start = time.perf_counter()
    preset = "tiny" if a.cpu else a.model
    hf = make_model(os.path.join(a.ckpt_root or a.out, preset), preset)
    transport = a.transport or ("distributed" if a.cpu else "tensor")
    modes = a.modes or ("abort,in_place,retract" + (",staged" if transport != "distributed" else ""))
    engine = Engine(model_path=hf, cpu_mode=a.cpu, tp=1, log_dir=os.path.join(a.out, "engines"), name="inflight",
                    max_running_requests=a.requests, max_total_tokens=8192 if a.cpu else None,
                    base_gpu_id=int(a.gpu), mem_fraction_static=None if a.cpu else a.mem_fraction,
                    dtype=None if a.cpu else "bfloat16", return_routed_experts=False,
                    server_args={} if a.cpu else {"cuda_graph_max_bs": a.requests})
    engine.start()
    try:
        engine.wait_healthy(timeout=1800)
        path = os.path.join(a.out, "inflight.json")
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                   PYTHONPATH=os.pathsep.join(p for p in (os.path.dirname(HERE), os.environ.get("PYTHONPATH")) if p))
        if not a.cpu:
            env["CUDA_VISIBLE_DEVICES"] = a.gpu
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
               os.path.join(HERE, "_inflight_worker.py"), "--hf", hf, "--dtype", "fp32" if a.cpu else "bf16",
               "--engine", f"{engine.url}@1", "--transport", transport, "--modes", modes, "--reps", str(a.reps),
               "--requests", str(a.requests), "--prompt-len", str(a.prompt_len), "--before", str(a.before),
               "--new", str(a.new or (200 if a.cpu else 1024)),
               "--after", str(a.after), "--out", path]
        subprocess.run(cmd, env=env, check=True, timeout=3600)
        with open(path) as f:
            raw = json.load(f)
    finally:
        engine.stop()
    result = {"model": preset, "transport": transport, "requests": a.requests, "prompt_len": a.prompt_len,
              "reps": a.reps, "summary": summarize(raw["rows"]), "rows": raw["rows"],
              "seconds": time.perf_counter() - t_start,
              "note": "generation pause = a request's longest wait for a token around the sync, less one decode "
                      "step; median over the requests; abort includes the resubmission's re-prefill"}
    dump(result, a.report, name=f"weight_sync_inflight_{slug(device_name())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
