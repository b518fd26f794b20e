"""Keep Routing overhead: training step time with replay on / off, same model, layout and batch.

    python bench/replay_overhead.py                       # CPU (gloo, fp32): tiny model, TP1 and TP2
    python bench/replay_overhead.py --preset stress_a
    python bench/replay_overhead.py --scale gpu --json r.json   # 2 GPUs, bf16: §13's 490M MoE, TP2(SP), EP2
    python bench/replay_overhead.py --compare packing --seq 256 --batch 8   # packed vs padded rows

A step is megatron's forward+backward through ``mrl.megatron.train_step.forward_backward`` over
``--micro-batches`` micro-batches (megatron's schedule). "on" passes a ``ReplayDriver`` in
``ReplayMode.replay`` fed with routes (the model's own natural routing, recorded once, so the experts'
loads are the same in both modes); "off" passes ``driver=None``. Modes alternate within each repetition
(order flipped every repetition) after a warm-up, each repetition on its own batch; the figure is the
median of the per-repetition ratios on / off, with their p25-p75 (goal <= 1.02; the ratio of the two
medians is kept beside it). Two checks
ride along: replaying the natural routes gives the natural logprobs, and replaying shifted routes
changes them (replay is really applied).

``--compare packing``: replay on in both modes; "off" puts one long-tailed sample per ``--seq`` row
(right-padded), "on" packs the same samples into first-fit-decreasing rows of ``--seq`` tokens
(block-diagonal causal mask), as many micro-batches; the check is packed == padded logprobs per sample.
"""

import argparse
import os
import tempfile

from rich.console import Console
from rich.table import Table

from _bench_common import device_name, dump, make_model, run_layouts, slug as _slug

LAYOUTS = {"tp1": (1, []), "tp2": (2, ["--tp", "2"]), "ep2": (2, ["--ep", "2"]),
           "tp2ep2": (2, ["--tp", "2", "--ep", "2", "--etp", "1"]), "pp2": (2, ["--pp", "2"])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument("--preset", default=None, help="tiny | stress_a | gpu (default: tiny on CPU, gpu on GPU)")
    ap.add_argument("--hf", default=None, help="use this checkpoint instead of generating one")
    ap.add_argument("--layouts", nargs="+", default=None)
    ap.add_argument("--batch", type=int, default=None, help="sequences per micro-batch per DP rank")
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--profile", action="store_true", help="profile one step per mode; print the top ops")
    ap.add_argument("--json", default=None, help="report path (default: bench/reports/<topic>/<date>_<name>.json)")
    ap.add_argument("--compare", choices=["replay", "packing"], default="replay")
    a = ap.parse_args()
    gpu = a.scale == "gpu"
    preset = a.preset or ("gpu" if gpu else "tiny")
    layouts = a.layouts or (["tp2", "ep2"] if gpu else ["tp1", "tp2"])
    batch, seq = a.batch or (4 if gpu else 2), a.seq or (1024 if gpu else 128)
    reps = a.reps or (10 if gpu else 12)
    dtype = "bf16" if gpu else "fp32"
    tmp = tempfile.mkdtemp(prefix="mrl_replay_bench_")
    hf = a.hf or make_model(os.path.join(tmp, preset), preset)
    rows = run_layouts("_replay_worker.py", layouts, LAYOUTS, tmp,
                       ["--hf", hf, "--dtype", dtype, "--batch", str(batch), "--seq", str(seq),
                        "--micro-batches", str(a.micro_batches), "--reps", str(reps), "--compare", a.compare,
                        *(["--profile"] if a.profile else [])])
    dev = device_name()
    if a.compare == "packing":
        _packing_table(rows, dev, preset, dtype, a.micro_batches, batch, seq, reps)
        dump({"bench": "packing", "device": dev, "preset": preset, "dtype": dtype, "micro_batches": a.micro_batches,
              "batch": batch, "seq": seq, "reps": reps, "layouts": rows}, a.json, name=f"packing_{_slug(dev)}")
        return
    t = Table(title=f"Keep Routing overhead, {dev}, {preset} ({dtype}), {a.micro_batches} micro-batches x "
                    f"{batch} x {seq} tokens per DP rank, {reps} interleaved reps")
    for c in ("layout", "off ms (median)", "on ms (median)", "on/off (median of pairs, p25-p75)", "on/off (min)",
              "host CPU s/step off, on", "replay=natural lp diff", "shifted routes lp diff"):
        t.add_column(c)
    for name, d in rows.items():
        paired = "{:.3f} ({:.3f}-{:.3f})".format(d["ratio_paired_median"], *d["ratio_paired_p25_p75"])
        t.add_row(name, f"{1e3 * d['off_median_s']:.1f}", f"{1e3 * d['on_median_s']:.1f}", paired,
                  f"{d['ratio_min']:.3f}", "{off:.2f}, {on:.2f}".format(**d["cpu_s_median"]),
                  f"{d.get('max_abs_logprob_diff_replay_vs_natural', float('nan')):.2g}",
                  f"{d.get('max_abs_logprob_diff_shifted_routes', float('nan')):.2g}")
    Console(width=160).print(t)
    for name, d in rows.items():
        for mode, p in d.get("profiles", {}).items():
            print(f"--- profile {name} replay {mode}: wall {p['wall_s'] * 1e3:.0f} ms, "
                  f"device busy {p['device_busy_s'] * 1e3:.0f} ms (rank 0)")
            print(p["top_cpu"])
            print(p["top_device"])
        for p in d.get("profiles", {}).values():
            p.pop("top_cpu"), p.pop("top_device")
    dump({"bench": "replay_overhead", "device": dev, "preset": preset, "dtype": dtype, "micro_batches": a.micro_batches,
          "batch": batch, "seq": seq, "reps": reps, "layouts": rows}, a.json, name=f"replay_overhead_{_slug(dev)}")


def _packing_table(rows, dev, preset, dtype, micro_batches, batch, seq, reps) -> None:
    t = Table(title=f"Sequence packing, replay on, {dev}, {preset} ({dtype}): {micro_batches * batch} long-tailed "
                    f"samples of <= {seq} tokens per DP rank, {micro_batches} micro-batches, {reps} interleaved reps")
    for c in ("layout", "padded ms (median)", "packed ms (median)", "packed/padded (median)", "packed/padded (min)",
              "tokens real / padded / packed", "rows padded -> packed", "packed=padded lp diff"):
        t.add_column(c)
    for name, d in rows.items():
        t.add_row(name, f"{1e3 * d['off_median_s']:.1f}", f"{1e3 * d['on_median_s']:.1f}", f"{d['ratio_median']:.3f}",
                  f"{d['ratio_min']:.3f}", f"{d['real_tokens']} / {d['padded_tokens']} / {d['packed_tokens']}",
                  f"{micro_batches * batch} -> {d['rows_packed']}",
                  f"{d.get('max_abs_logprob_diff_packed_vs_padded', float('nan')):.2g}")
    Console(width=180).print(t)


if __name__ == "__main__":
    main()
