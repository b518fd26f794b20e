"""fwd+bwd step time and peak memory of the Megatron model per layout, on this machine (CPU/gloo or GPUs).

    python bench/fwd_bwd_layouts.py [--preset stress_a] [--batch 4] [--seq 128]

Each layout runs in its own torchrun (same global batch); ratios are against TP1 measured in the
same run. On a 2-core box the multi-process layouts oversubscribe the cores: read the ratios as the
cost of the parallel machinery (collectives, dispatch), not as speed-ups.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

from rich.console import Console
from rich.table import Table

from _bench_common import device_name, dump, slug

LAYOUTS = [
    ("TP1", 1, []),
    ("TP2+SP", 2, ["--tp", "2"]),
    ("EP2", 2, ["--ep", "2"]),
    ("TP2xEP2 (ETP1)", 2, ["--tp", "2", "--ep", "2", "--etp", "1"]),
    ("PP2", 2, ["--pp", "2"]),
    ("TP2xEP2xETP2, DP2", 4, ["--tp", "2", "--ep", "2", "--etp", "2"]),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="stress_a")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--json", default=None, help="report path (default: bench/reports/<topic>/<date>_<name>.json)")
    a = ap.parse_args()
    from mrl.config.schema import TinyPreset
    from mrl.models.tiny import make_tiny_model

    tmp = tempfile.mkdtemp(prefix="mrl_bench_")
    hf = make_tiny_model(os.path.join(tmp, a.preset), TinyPreset(a.preset))
    rows = []
    for name, n, args in LAYOUTS:
        out = os.path.join(tmp, "r.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
               os.path.join(os.path.dirname(__file__), "_fwd_bwd_worker.py"), "--hf", hf, "--out", out,
               "--batch", str(a.batch), "--seq", str(a.seq), "--steps", str(a.steps), *args]
        r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        if r.returncode:
            print(r.stderr[-3000:])
            raise SystemExit(f"{name} failed")
        rows.append((name, n, json.load(open(out))))
    base = rows[0][2]["min_ms"]
    t = Table(title=f"fwd+bwd, {a.preset}, global batch {a.batch} x seq {a.seq}, fp32")
    for c in ("layout", "procs", "min ms", "median ms", "x TP1 (min)", "peak RSS MB (max rank)", "peak RSS MB (sum)"):
        t.add_column(c)
    for name, n, d in rows:
        t.add_row(name, str(n), f"{d['min_ms']:.1f}", f"{d['median_ms']:.1f}", f"{d['min_ms'] / base:.2f}",
                  f"{d['peak_rss_mb_max_rank']:.0f}", f"{d['peak_rss_mb_sum']:.0f}")
    Console(width=150).print(t)
    dump({"bench": "fwd_bwd_layouts", "device": device_name(), "preset": a.preset, "batch": a.batch, "seq": a.seq,
          "steps": a.steps, "layouts": [dict(layout=name, procs=n, **d) for name, n, d in rows]}, a.json,
         name=f"fwd_bwd_layouts_{slug(device_name())}")


if __name__ == "__main__":
    main()
