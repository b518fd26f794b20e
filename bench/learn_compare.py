"""Learning runs side by side (e.g. FP8 rollouts against bf16 ones, the same task and seed): one PNG of their
curves and a JSON of each run's summary and every step, read from the runs' ``metrics.jsonl``.

    python bench/learn_compare.py --run bf16=WORK/learnbf --run fp8=WORK/learnfp8 \\
        --out report.json --png curves.png

Per run: the reward of the first and last 10 steps, the first and last held-out accuracy, and the medians
(p25-p75) of the engine-vs-trainer KL (replay on, and by cause), the routing disagreement, the weight sync
and the step, the first step left out (it fills the pipeline).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

PANELS = [("reward", "train reward (sampled)"), ("eval/accuracy", "eval accuracy (greedy, held out)"),
          ("kl_engine_replay_on", "KL engine->train, replay on"), ("routing_disagreement", "routing disagreement"),
          ("sync_seconds", "weight sync [s]"), ("step_seconds", "step [s]")]
MEDIANS = ("kl_engine_replay_on", "kl_engine_replay_off", "mismatch/numerics_kl", "mismatch/routing_kl",
           "mismatch/stale_kl", "routing_disagreement", "sync_seconds", "step_seconds")


def read_rows(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (not an mrl train run directory?)")
    return [json.loads(line) for line in open(path) if line.strip()]


def quartiles(xs: list[float]) -> dict | None:
    if not xs:
        return None
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return {"median": statistics.median(xs), "p25": q[0], "p75": q[2], "n": len(xs)}


def summarize(rows: list[dict]) -> dict:
    """A run's figures (see the module's docstring) from its ``metrics.jsonl`` rows."""
    steps = [r for r in rows if "step_seconds" in r]
    if not steps:
        raise ValueError("no RL step in metrics.jsonl")
    rewards = [r["reward"] for r in steps if "reward" in r]
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    out = {"steps": len(steps), "reward_first": rewards[0], "reward_final": rewards[-1],
           "reward_first10_mean": statistics.fmean(rewards[:10]), "reward_last10_mean": statistics.fmean(rewards[-10:]),
           "eval_accuracy": evals, "eval_accuracy_first": evals[0][1] if evals else None,
           "eval_accuracy_final": evals[-1][1] if evals else None}
    for k in MEDIANS:
        out[k] = quartiles([r[k] for r in steps[1:] if isinstance(r.get(k), (int, float))])
    return out


def plot(runs: dict[str, list[dict]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    for ax, (key, name) in zip(axes.flat, PANELS):
        for run, rows in runs.items():
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            if pts:
                ax.plot(*zip(*pts), label=run, marker="." if key == "eval/accuracy" else None)
        if key.startswith("kl"):
            ax.set_yscale("symlog", linthresh=1e-6)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", action="append", required=True, metavar="NAME=DIR", help="a run directory, named")
    ap.add_argument("--out", required=True, help="the JSON report")
    ap.add_argument("--png", default=None, help="the curves side by side (default: the report's name, .png)")
    ap.add_argument("--title", default="learning runs side by side")
    a = ap.parse_args()
    runs = {}
    for spec in a.run:
        name, sep, run_dir = spec.partition("=")
        if not sep or not name or not run_dir:
            ap.error(f"--run {spec!r}: expected NAME=DIR")
        runs[name] = read_rows(run_dir)
    png = a.png or os.path.splitext(a.out)[0] + ".png"
    plot(runs, png, a.title)
    report = {"bench": "learn_compare", "runs": list(runs), "png": os.path.basename(png),
              "summary": {k: summarize(v) for k, v in runs.items()}, "steps": runs}
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    for name, s in report["summary"].items():
        med = {k: (s[k] or {}).get("median", float("nan")) for k in ("kl_engine_replay_on", "sync_seconds")}
        print(f"[learn_compare] {name}: reward {s['reward_first10_mean']:.3f} -> {s['reward_last10_mean']:.3f} "
              f"(first/last 10 steps), eval {s['eval_accuracy_first']} -> {s['eval_accuracy_final']}, "
              f"KL on {med['kl_engine_replay_on']:.3g}, sync {med['sync_seconds']:.3g} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
