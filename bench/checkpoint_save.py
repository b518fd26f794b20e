"""Host memory and seconds of a trainer checkpoint save, per ``train.optimizer_checkpoint`` format.

    python bench/checkpoint_save.py [--preset cpu_ckpt] [--nproc 1] [--reps 3] [--json PATH]

Each repetition is a fresh trainer process (``--nproc`` ranks, EP = nproc) that builds mrl's ``Policy`` on a
random checkpoint, runs one RL step (so the optimizer holds Adam state) and saves once; formats alternate
(ABAB...). A thread samples the rank's resident memory every 5 ms: ``peak_extra_gib`` is the peak during
``Policy.save`` above the resident memory just before it, on the rank that peaks highest. Separate processes
keep one save's freed-but-retained heap out of the next one's figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _bench_common import dump, make_model, torchrun  # noqa: E402

FORMATS = ("dp_reshardable", "fully_reshardable")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="cpu_ckpt")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    runs = {f: [] for f in FORMATS}
    with tempfile.TemporaryDirectory() as tmp:
        hf = make_model(os.path.join(tmp, "model"), a.preset)
        for rep in range(a.reps):
            for fmt in FORMATS if rep % 2 == 0 else FORMATS[::-1]:
                out = os.path.join(tmp, f"{fmt}_{rep}.json")
                torchrun(a.nproc, "_checkpoint_save_worker.py",
                         ["--hf", hf, "--format", fmt, "--ckpt", os.path.join(tmp, f"ck_{fmt}_{rep}"), "--out", out],
                         timeout=1800)
                ranks = [json.load(open(f"{out}.rank{r}")) for r in range(a.nproc)]
                runs[fmt].append({"peak_extra_gib": max(r["peak_extra_gib"] for r in ranks),
                                  "save_s": max(r["save_s"] for r in ranks),
                                  "checkpoint_gib": ranks[0]["checkpoint_gib"], "per_rank": ranks})
                print(f"[bench] {fmt} rep {rep}: +{runs[fmt][-1]['peak_extra_gib']:.2f} GiB, "
                      f"{runs[fmt][-1]['save_s']:.1f} s", file=sys.stderr, flush=True)
    params = runs[FORMATS[0]][0]["per_rank"][0]["params_this_rank"]
    summary = {f: {k: statistics.median(r[k] for r in runs[f]) for k in ("peak_extra_gib", "save_s", "checkpoint_gib")}
               | {"peak_extra_gib_min_max": [min(r["peak_extra_gib"] for r in runs[f]),
                                             max(r["peak_extra_gib"] for r in runs[f])]} for f in FORMATS}
    result = {"bench": "checkpoint_save", "preset": a.preset, "nproc": a.nproc, "reps": a.reps,
              "statistic": "median over repetitions, each a fresh process; formats alternate",
              "params_per_rank": params, "summary": summary, "runs": runs}
    for f in FORMATS:
        s = summary[f]
        print(f"{f}: host memory +{s['peak_extra_gib']:.2f} GiB during the save "
              f"({s['peak_extra_gib'] * 2**30 / params:.1f} bytes per parameter of the rank), {s['save_s']:.1f} s")
    dump(result, a.json, name=f"checkpoint_save_{a.preset}_{a.nproc}proc")


if __name__ == "__main__":
    main()
