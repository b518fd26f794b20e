"""RL train step vs bare forward/backward: tokens/s of ``Policy.rl_step`` against megatron's plain
forward/backward of the same model, layout and batch, measured in one run.

    python bench/rl_step_vs_bare.py                          # CPU (gloo, fp32): tiny model, TP1
    python bench/rl_step_vs_bare.py --scale gpu --json r.json   # 2 GPUs, bf16: §13's 490M MoE, TP2(SP), EP2

The RL step is the real one (``mrl.megatron.policy.Policy`` built from a ``Config``): the batch goes
through Policy's micro-batch/padding path, replays the routes (the model's natural routing, recorded
once), computes ``mrl.algo.compute_policy_loss`` (GRPO, TIS correction), steps the optimizer and
reduces its metrics. The bare step feeds the same padded micro-batches to megatron's
forward_backward_func with ``labels`` (megatron's vocab-parallel cross-entropy), no replay. Reported:
tokens/s (real tokens, median step) of rl_step, rl_fb (rl_step without the optimizer step and
metrics), bare_fb and bare_step (bare_fb + the same optimizer step), and the throughput ratios
rl_step/bare_fb (the brief's goal >= 0.9), rl_step/bare_step (like for like: both step the optimizer)
and rl_fb/bare_fb (forward/backward only); ce_fb (mrl's forward_backward with a plain NLL, no
replay) splits the last one into mrl's logprob path and the RL loss + replay. Each ratio three ways:
of the median steps (the headline), of the fastest steps, and per repetition (every kind runs on the
same batch in each repetition) as median [p25, p75]: host-bound steps vary by +-20% between
repetitions, the paired spread shows how far a ratio can be trusted. ``--fns`` times a subset (at
least rl_step, bare_fb, bare_step).
"""

import argparse
import os
import tempfile

from rich.console import Console
from rich.table import Table

from _bench_common import device_name, dump, make_model, run_layouts, slug

LAYOUTS = {"tp1": (1, []), "tp2": (2, ["--tp", "2"]), "ep2": (2, ["--ep", "2"]),
           "tp2ep2": (2, ["--tp", "2", "--ep", "2", "--etp", "1"])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument("--preset", default=None, help="tiny | stress_a | gpu (default: tiny on CPU, gpu on GPU)")
    ap.add_argument("--hf", default=None)
    ap.add_argument("--layouts", nargs="+", default=None)
    ap.add_argument("--samples", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--micro-batch-size", type=int, default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--phases", type=int, default=0, help="then time rl_step's phases over this many steps")
    ap.add_argument("--block", type=int, default=1,
                    help="steps of one kind in a row per repetition; the median of all but the first is timed")
    ap.add_argument("--fns", default=None, help="step kinds to time (worker's --fns; default all five)")
    ap.add_argument("--packing", choices=["on", "off"], default="on", help="train.packing of the RL step")
    ap.add_argument("--json", default=None, help="report path (default: bench/reports/<topic>/<date>_<name>.json)")
    a = ap.parse_args()
    gpu = a.scale == "gpu"
    preset = a.preset or ("gpu" if gpu else "tiny")
    layouts = a.layouts or (["tp2", "ep2"] if gpu else ["tp1"])
    samples, seq = a.samples or (16 if gpu else 8), a.seq or (1024 if gpu else 64)
    mbs = a.micro_batch_size or (4 if gpu else 2)
    reps = a.reps or (16 if gpu else 5)
    warmup = a.warmup if a.warmup is not None else (3 if gpu else 2)
    dtype = "bf16" if gpu else "fp32"
    tmp = tempfile.mkdtemp(prefix="mrl_rl_bench_")
    hf = a.hf or make_model(os.path.join(tmp, preset), preset)
    rows = run_layouts("_rl_step_worker.py", layouts, LAYOUTS, tmp,
                       ["--hf", hf, "--dtype", dtype, "--samples", str(samples), "--seq", str(seq),
                        "--micro-batch-size", str(mbs), "--reps", str(reps), "--warmup", str(warmup),
                        "--packing", a.packing, "--phases", str(a.phases), "--block", str(a.block),
                        *(["--fns", a.fns] if a.fns else [])])
    dev = device_name()
    t = Table(title=f"RL step vs bare fwd/bwd, {dev}, {preset} ({dtype}), {samples} samples <= {seq} tokens, "
                    f"micro-batch {mbs}, packing {a.packing}, {reps} interleaved reps"
                    f"{f' of {a.block}-step blocks' if a.block > 1 else ''} after {warmup} warm-up")
    kinds = ("rl_step", "rl_fb", "ce_fb", "bare_fb", "bare_step")
    for c in ("layout", *(f"{k} tok/s" for k in kinds), "ratio", "of medians", "of mins", "paired median [p25, p75]"):
        t.add_column(c)
    for name, d in rows.items():
        tps = d["tokens_per_s"]
        cells = [f"{tps[k]:.0f}" if k in tps else "-" for k in kinds]
        for i, key in enumerate(k for k in ("rl_step_vs_bare_fb", "rl_step_vs_bare_step", "rl_fb_vs_bare_fb",
                                            "rl_fb_vs_ce_fb") if k in d):
            p = d.get(key + "_paired")
            t.add_row(name if i == 0 else "", *(cells if i == 0 else [""] * len(kinds)), key.replace("_vs_", "/"),
                      f"{d[key]:.3f}", f"{d[key + '_min']:.3f}" if key + "_min" in d else "-",
                      f"{p['median']:.3f} [{p['p25']:.3f}, {p['p75']:.3f}]" if p else "-")
    Console(width=170).print(t)
    for name, d in rows.items():
        if d.get("rl_step_phases_s"):
            print(f"{name} rl_step phases (s, median of {a.phases}, synchronized):",
                  {k: round(v, 4) for k, v in d["rl_step_phases_s"].items()})
    dump({"bench": "rl_step_vs_bare", "device": dev, "preset": preset, "dtype": dtype, "samples": samples, "seq": seq,
          "micro_batch_size": mbs, "packing": a.packing, "reps": reps, "block": a.block, "warmup": warmup,
          "layouts": rows}, a.json,
         name=f"rl_step_vs_bare_{slug(device_name())}")


if __name__ == "__main__":
    main()
