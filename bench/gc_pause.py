"""What a full garbage collection pauses a trainer rank for, with and without ``train.gc_freeze``.

    python bench/gc_pause.py [--preset tiny] [--reps 7] [--json PATH]

One trainer process (world size 1, CPU or one GPU) builds mrl's ``Policy`` (megatron-core, the model,
DDP, the optimizer: the heap every trainer rank carries) on a random checkpoint, runs one RL step, then
times ``gc.collect()`` ``--reps`` times on that heap, then freezes it as the trainer does
(``StepCollector.after_setup``) and times it again. The GPU benches record the same pause as it happens
inside steps (``gc`` in ``rl_step_vs_megatron.py``'s report); this one isolates it.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _bench_common import dump, make_model, torchrun  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        hf = make_model(os.path.join(tmp, "model"), a.preset)
        out = os.path.join(tmp, "gc.json")
        torchrun(1, "_gc_pause_worker.py", ["--hf", hf, "--reps", str(a.reps), "--out", out], timeout=900)
        import json

        result = {"bench": "gc_pause", "preset": a.preset, "reps": a.reps, **json.load(open(out))}
    print(f"full collection: {result['unfrozen']['median_ms']:.1f} ms over {result['unfrozen']['tracked_objects']} "
          f"tracked objects; frozen: {result['frozen']['median_ms']:.2f} ms over "
          f"{result['frozen']['tracked_objects']}")
    dump(result, a.json, name="gc_pause")


if __name__ == "__main__":
    main()
