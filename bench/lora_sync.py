"""Adapter-only sync vs full-weight sync into the same live SGLang CPU engine: bytes and seconds.

    python bench/lora_sync.py                       # tiny Qwen3-MoE, attention adapters r=8 and r=64, 5 reps
    python bench/lora_sync.py --reps 9 --ranks 8 16 --preset stress_a

One engine (CPU mode, TP1) started with the LoRA flags serves both kinds. Full weights go through mrl's
weight sync (``FullWeightChannel``: pause, flush, push, stamp, continue) over the distributed transport (gloo)
and the disk transport; adapters through ``mrl.weight_sync.adapter.AdapterSync`` from tensors (HTTP) and
from disk (PEFT directory), a new version each time, the previous one unloaded afterwards. Per kind:
wall seconds of the sync as the trainer sees it, bytes (tensor bytes; for adapters also the bytes on the
wire), the engine's own load time for adapters, and the latency of the first request on the new weights.
The adapters are random (``random_adapter``), so the trainer-side export (``export_peft``) is not in the
adapter times, while the full sync includes its HF conversion. Medians with p25-p75, every repetition
kept, in ``bench/reports/weight_sync/<date>_lora_sync_cpu.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from _bench_common import dump, make_model, torchrun  # noqa: E402

from mrl.engine.launcher import Engine  # noqa: E402
from mrl.config.lora_engine import ATTENTION, LoraEngineSpec  # noqa: E402
from mrl.sglang.keys import ensure_run_secrets  # noqa: E402


def summary(xs: list[float]) -> dict:
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return {"median": statistics.median(xs), "p25": q[0], "p75": q[2]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", help="checkpoint preset (bench/_bench_common.make_model)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    load_start = os.getloadavg()  # the box may be shared: other work inflates every time here
    tmp = tempfile.mkdtemp(prefix="lora_sync_")
    hf = make_model(os.path.join(tmp, "model"), a.preset)
    keys = ensure_run_secrets(os.path.join(tmp, "run"))  # exports $MRL_ENGINE_KEYS_FILE for the worker
    eng = Engine(model_path=hf, tp=1, log_dir=os.path.join(tmp, "logs"), name="lora_bench", secrets=keys,
                 lora=LoraEngineSpec(max_rank=max(a.ranks), targets=ATTENTION, slots=4))
    eng.start()
    try:
        eng.wait_healthy(timeout=600)
        out = os.path.join(tmp, "worker.json")
        torchrun(1, "_lora_sync_worker.py", ["--hf", hf, "--engine", eng.url, "--ranks", *map(str, a.ranks),
                                             "--reps", str(a.reps), "--export-dir", os.path.join(tmp, "export"),
                                             "--out", out], timeout=900)
    finally:
        eng.stop()
    import json

    with open(out) as f:
        res = json.load(f)
    rows = res["reps"]
    table = {}
    for kind, reps in rows.items():
        table[kind] = {"seconds": summary([r["seconds"] for r in reps]),
                       "first_use_s": summary([r["first_use_s"] for r in reps]),
                       "bytes": reps[0]["bytes"], "engine_paused": reps[0]["engine_paused"]}
        if "wire_bytes" in reps[0]:
            table[kind]["wire_bytes"] = reps[0]["wire_bytes"]
            table[kind]["engine_load_s"] = summary([r["engine_load_s"] for r in reps])
        if "unload_previous_s" in reps[0]:
            table[kind]["unload_previous_s"] = summary([r["unload_previous_s"] for r in reps])
    full = table["full_distributed"]
    ratios = {k: {"bytes_full_over_adapter": full["bytes"] / v["bytes"],
                  "seconds_full_distributed_over_adapter": full["seconds"]["median"] / v["seconds"]["median"]}
              for k, v in table.items() if k.startswith("adapter")}
    for k, v in table.items():
        s = v["seconds"]
        print(f"{k:28s} {v['bytes'] / 1024:9.1f} KiB  {s['median'] * 1e3:8.1f} ms "
              f"[{s['p25'] * 1e3:.1f}-{s['p75'] * 1e3:.1f}]  first use {v['first_use_s']['median'] * 1e3:.1f} ms"
              f"  paused: {v['engine_paused']}")
    result = {"bench": "lora_sync_cpu", "model": a.preset, "engine": "SGLang CPU mode, TP1, fp32, --lora-backend "
              f"torch_native, --max-lora-rank {max(a.ranks)}, attention targets", "reps_per_kind": a.reps,
              "adapter_ranks": a.ranks, "summary": table, "ratios": ratios,
              "full_weight_bytes": res["full_weight_bytes"], "reps": rows,
              "load_average_1_5_15min": {"start": load_start, "end": os.getloadavg()},
              "notes": "seconds = the trainer's wall time of one sync (full: pause..continue, the engine paused "
                       "throughout; adapter: checks + serialization or PEFT export + the engine's load, no pause). "
                       "Adapters are random: the trainer-side export_peft is not in their time; the full sync "
                       "includes its HF conversion. first_use_s: one request of one token on the new weights."}
    dump(result, a.out, name="lora_sync_cpu")


if __name__ == "__main__":
    main()
