"""Host memory and seconds of a trainer checkpoint save, per ``train.optimizer_checkpoint`` format.

    python bench/checkpoint_save.py [--preset cpu_ckpt] [--nproc 1] [--reps 3] [--json PATH]
    python bench/checkpoint_save.py --async-save ...    # dp_reshardable, synchronous vs train.async_save

Each repetition is a fresh trainer process (``--nproc`` ranks, EP = nproc) that builds mrl's ``Policy`` on a
random checkpoint, runs one RL step (so the optimizer holds Adam state) and saves once; formats alternate
(ABAB...). A thread samples the rank's resident memory every 5 ms: ``peak_extra_gib`` is the peak during
``Policy.save`` above the resident memory just before it, on the rank that peaks highest. Separate processes
keep one save's freed-but-retained heap out of the next one's figure. With ``--async-save`` the two
variants are the default format saved synchronously and asynchronously: ``save_s`` is what the training
loop waits for, ``written_s`` the time until the asynchronous save is complete.
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
    ap.add_argument("--async-save", action="store_true",
                    help="compare dp_reshardable saved synchronously and with train.async_save")
    a = ap.parse_args()
    variants = {"dp_reshardable": [], "dp_reshardable_async": ["--async-save"]} if a.async_save else \
        {f: [] for f in FORMATS}
    names = list(variants)
    runs = {f: [] for f in names}
    with tempfile.TemporaryDirectory() as tmp:
        hf = make_model(os.path.join(tmp, "model"), a.preset)
        for rep in range(a.reps):
            for name in names if rep % 2 == 0 else names[::-1]:
                out = os.path.join(tmp, f"{name}_{rep}.json")
                torchrun(a.nproc, "_checkpoint_save_worker.py",
                         ["--hf", hf, "--format", name.removesuffix("_async"), "--ckpt",
                          os.path.join(tmp, f"ck_{name}_{rep}"), "--out", out, *variants[name]], timeout=1800)
                ranks = [json.load(open(f"{out}.rank{r}")) for r in range(a.nproc)]
                runs[name].append({"peak_extra_gib": max(r["peak_extra_gib"] for r in ranks),
                                   "save_s": max(r["save_s"] for r in ranks),
                                   "written_s": max(r["written_s"] or r["save_s"] for r in ranks),
                                   "checkpoint_gib": ranks[0]["checkpoint_gib"], "per_rank": ranks})
                print(f"[bench] {name} rep {rep}: +{runs[name][-1]['peak_extra_gib']:.2f} GiB, "
                      f"{runs[name][-1]['save_s']:.1f} s", file=sys.stderr, flush=True)
    params = runs[names[0]][0]["per_rank"][0]["params_this_rank"]
    summary = {f: {k: statistics.median(r[k] for r in runs[f])
                   for k in ("peak_extra_gib", "save_s", "written_s", "checkpoint_gib")}
               | {"peak_extra_gib_min_max": [min(r["peak_extra_gib"] for r in runs[f]),
                                             max(r["peak_extra_gib"] for r in runs[f])]} for f in names}
    result = {"bench": "checkpoint_save", "preset": a.preset, "nproc": a.nproc, "reps": a.reps,
              "statistic": "median over repetitions, each a fresh process; formats alternate",
              "params_per_rank": params, "summary": summary, "runs": runs}
    for f in names:
        s = summary[f]
        print(f"{f}: host memory +{s['peak_extra_gib']:.2f} GiB during the save "
              f"({s['peak_extra_gib'] * 2**30 / params:.1f} bytes per parameter of the rank), {s['save_s']:.1f} s"
              + (f" waited for, complete after {s['written_s']:.1f} s" if f.endswith("_async") else ""))
    dump(result, a.json, name=f"checkpoint_save_{a.preset}_{a.nproc}proc{'_async' if a.async_save else ''}")


if __name__ == "__main__":
    main()
