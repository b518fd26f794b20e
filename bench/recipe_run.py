"""A recipe's learning, measured: ``mrl train +experiment=<recipe>`` (``--recipe default``: the default run) once
per variant and seed, its held-out evaluations over the steps (``train.eval_sets``: greedy pass@1 and sampled
pass@k), the reward, the wall time, the clip fractions and the mismatch split, in one report with a plot.

    .venv/bin/python bench/recipe_run.py --recipe countdown --seeds 1 2 3
    .venv/bin/python bench/recipe_run.py --recipe default --name minibatch_default --seeds 1 2 3 --target 0.9 \\
        --set algo=dapo algo.overlong_shaping=false algo.dynamic_sampling=false --group minibatches=algo.mini_batches \\
        --variant mb4:algo.mini_batches=4 --variant mb1:algo.mini_batches=1
    python3 bench/recipe_run.py --recipe countdown --seeds 1 --parallel 2 \\
        --set model=small_gpu engine=gpu weight_sync.transport=tensor engine.base_gpu_id=0 \\
        engine.mem_fraction_static=0.25 --variant replay_on:train.replay=true --variant replay_off:train.replay=false

(without --out the report goes to bench/reports/learning/<date>_mrl_train_<name>_<hardware>.json, ``--name`` by
default ``recipe_<recipe>``, the plot beside it). Per run: the evaluations of the first set (``eval/<set>/...`` rows
of ``metrics.jsonl``), of which ``heldout_pass_at_1_start`` (the evaluation before the first RL step, after the warm
start) and ``heldout_pass_at_1_end`` (the last one) are the sampled pass@1, or the greedy one where the set samples
nothing; the reward of the first and last 10 steps; the medians of the mismatch split (``mismatch/*``) and of the
step; the clip fractions of every step (``clip_frac_high``, ``clip_frac_low``: the trainer's, averaged over the
batch's optimizer steps) and of the mini-batches after the first (``minibatch/<j>/*``, j >= 1). With ``--target T``:
the steps, trained samples, rollouts completed and loop seconds (``wall_seconds`` of ``metrics.jsonl``) until the
training reward's trailing mean over ``--target-window`` steps first reaches T (None: not reached). The summary
gives, per variant, the lift (end - start) of every run and its median, the steps to the target of every run and
their median (a run that never reached it counts as beyond every other), and the clip fractions' median and mean
over every step of its runs; ``--group NAME=KEY`` adds ``steps_to_<T%>_by_<NAME>``: the steps to the target by the
value of override KEY in each variant. ``--reuse`` reads the runs under ``--keep`` that finished (a call cut short
goes on where it stopped).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from _bench_common import REPORTS, device_name, dump, slug

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mrl_command() -> list[str]:
    return [sys.executable, "-m", "mrl"]


def eval_rows(rows: list[dict], name: str) -> list[dict]:
    """The evaluations of set ``name``, in step order: step, greedy pass@1, pass@k per k, versions."""
    prefix = f"eval/{name}/"
    out = []
    for r in rows:
        got = {k[len(prefix):]: v for k, v in r.items() if k.startswith(prefix)}
        if got:
            out.append({"step": r["step"], **got})
    return sorted(out, key=lambda e: e["step"])


def pass_at_1(e: dict) -> float | None:
    return e.get("pass_at_1", e.get("greedy_pass_at_1"))


def median_of(rows: list[dict], key: str) -> float | None:
    xs = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return statistics.median(xs) if xs else None


def to_target(steps: list[dict], target: float, window: int) -> dict:
    """Where the reward's trailing mean over ``window`` steps first reaches ``target``: that step, the samples
    trained up to it (the staleness histogram counts every trained sample), the rollouts completed by then and
    the loop's seconds; None each where it never does."""
    rewards = [r["reward"] for r in steps]
    for i in range(window - 1, len(steps)):
        if statistics.fmean(rewards[i - window + 1:i + 1]) >= target:
            r = steps[i]
            trained = sum((r.get("staleness_hist") or {}).values()) or None
            return {"steps_to_target": r["step"], "samples_to_target": trained,
                    "rollouts_to_target": r.get("rollout/samples_completed"),
                    "seconds_to_target": r.get("wall_seconds")}
    return dict.fromkeys(("steps_to_target", "samples_to_target", "rollouts_to_target", "seconds_to_target"))


def clip_fractions(steps: list[dict]) -> dict:
    """Per step: the trainer's clip fractions (``clip_frac_high``/``low``, averaged over the batch's optimizer
    steps) and their mean over the mini-batches after the first, where the ratio can leave 1."""
    out = {}
    for key in ("clip_frac_high", "clip_frac_low"):
        out[key] = [r.get(key) for r in steps]
        later = []
        for r in steps:
            xs = [v for k, v in r.items() if k.startswith("minibatch/") and k.endswith("/" + key)
                  and k.split("/")[1] != "0"]
            later.append(statistics.fmean(xs) if xs else None)
        out[key + "_later_minibatches"] = later
    return out


def summarize(rows: list[dict], set_name: str, target: float | None = None, window: int = 5) -> dict:
    """One run's figures from its ``metrics.jsonl`` rows."""
    steps = [r for r in rows if "step_seconds" in r]
    rewards = [r["reward"] for r in steps if "reward" in r]
    evals = eval_rows(rows, set_name)
    if not evals:
        raise RuntimeError(f"the run reported no evaluation of set {set_name!r} (train.eval_sets)")
    mismatch = sorted({k for r in steps for k in r if k.startswith("mismatch/")})
    return {
        "heldout_pass_at_1_start": pass_at_1(evals[0]), "heldout_pass_at_1_end": pass_at_1(evals[-1]),
        "heldout_greedy_pass_at_1_start": evals[0].get("greedy_pass_at_1"),
        "heldout_greedy_pass_at_1_end": evals[-1].get("greedy_pass_at_1"),
        "pass_at_k": [{k: v for k, v in e.items() if k == "step" or k.startswith(("pass_at_", "greedy"))}
                      for e in evals],
        "evaluations": evals,
        "reward_first10": statistics.mean(rewards[:10]) if rewards else None,
        "reward_last10": statistics.mean(rewards[-10:]) if rewards else None,
        "rewards": rewards,
        "reward_wall_seconds": [r.get("wall_seconds") for r in steps if "reward" in r],
        "clip": clip_fractions(steps),
        **(to_target([r for r in steps if "reward" in r], target, window) if target is not None else {}),
        "median_step_seconds": median_of(steps[1:], "step_seconds"),
        "mismatch_split_median": {k: median_of(steps, k) for k in mismatch},
        "warm_start_nll_last": next((r["sft/nll"] for r in reversed(rows) if "sft/nll" in r), None),
    }


def run_logged(cmd: list[str], run_dir: str, timeout: float) -> float:
    """Run ``cmd`` (an ``mrl train``) with its output in ``run_dir.log``; its wall seconds, or an error with the
    log's tail."""
    t0 = time.monotonic()
    with open(run_dir + ".log", "w") as log:
        p = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=log,
                           stderr=subprocess.STDOUT, timeout=timeout)
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{open(run_dir + '.log').read()[-3000:]}")
    return time.monotonic() - t0


def run_one(recipe: str, variant: tuple[str, list[str]], seed: int, sets: list[str], run_dir: str,
            set_name: str, timeout: float, delay: float = 0.0, target: float | None = None, window: int = 5,
            reuse: bool = False, save_hf: bool = False) -> dict:
    name, overrides = variant
    experiment = [] if recipe == "default" else [f"+experiment={recipe}"]
    cmd = [*mrl_command(), "train", *experiment, f"run_dir={run_dir}", f"seed={seed}",
           f"train.save_hf={str(save_hf).lower()}", *sets, *overrides]
    wall_file = run_dir + ".wall_seconds"
    if reuse and os.path.exists(os.path.join(run_dir, "summary.json")):  # written as a run ends
        wall = float(open(wall_file).read()) if os.path.exists(wall_file) else None
        print(f"[bench] {name} seed {seed}: the finished run in {run_dir} is read, not run again", file=sys.stderr)
    else:
        time.sleep(delay)
        wall = run_logged(cmd, run_dir, timeout)
        with open(wall_file, "w") as f:
            f.write(str(wall))
    rows = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
    got = summarize(rows, set_name, target, window)
    reached = f", steps to target {got['steps_to_target']}" if target is not None else ""
    print(f"[bench] {name} seed {seed}: pass@1 {got['heldout_pass_at_1_start']:.3f} -> "
          f"{got['heldout_pass_at_1_end']:.3f}{reached}" + (f", wall {wall:.0f} s" if wall is not None else ""),
          file=sys.stderr, flush=True)
    return {"variant": name, "seed": seed, "overrides": overrides, "wall_seconds": wall, **got}


def make_models(sets: list[str], tmp: str) -> list[str]:
    """Runs side by side would each make the same random model at once: make it here, and point them at it."""
    sys.path.insert(0, REPO)
    from mrl.config.load import compose
    from mrl.models.tiny import make_tiny_model

    cfg = compose([*sets])
    if not cfg.model.make_tiny_if_missing or os.path.exists(os.path.join(cfg.model.hf_path, "config.json")):
        return []
    path = os.path.join(tmp, "model")
    make_tiny_model(path, cfg.model.tiny_preset)
    return [f"model.hf_path={path}"]


def plot(runs: list[dict], path: str, title: str, target: float | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ((ax, bx), (cx, dx)) = plt.subplots(2, 2, figsize=(13, 9))
    colors = {v: f"C{i}" for i, v in enumerate(dict.fromkeys(r["variant"] for r in runs))}
    styles = {s: ls for s, ls in zip(sorted({r["seed"] for r in runs}), ["-", "--", ":", "-."] * 4)}
    for r in runs:
        label, color, ls = f"{r['variant']} s{r['seed']}", colors[r["variant"]], styles[r["seed"]]
        steps = [e["step"] for e in r["evaluations"]]
        ax.plot(steps, [pass_at_1(e) for e in r["evaluations"]], marker="o", ms=3, color=color, ls=ls,
                label=f"{label} pass@1")
        ks = sorted({k for e in r["evaluations"] for k in e if k.startswith("pass_at_") and k != "pass_at_1"})
        for k in ks[-1:]:
            ax.plot(steps, [e.get(k) for e in r["evaluations"]], ls=":", color=color,
                    label=f"{label} {k.replace('_at_', '@')}")
        bx.plot(range(1, len(r["rewards"]) + 1), r["rewards"], color=color, ls=ls, alpha=0.7, label=label)
        if all(t is not None for t in r["reward_wall_seconds"]):
            cx.plot(r["reward_wall_seconds"], r["rewards"], color=color, ls=ls, alpha=0.7, label=label)
        clip = r["clip"]
        n = range(1, len(clip["clip_frac_high"]) + 1)
        dx.plot(n, [x or 0.0 for x in clip["clip_frac_high"]], color=color, ls=ls, alpha=0.8, label=f"{label} high")
        dx.plot(n, [-(x or 0.0) for x in clip["clip_frac_low"]], color=color, ls=ls, alpha=0.4)
    ax.set(xlabel="RL step (0: after the warm start)", ylabel="held-out", ylim=(0, 1.02), title="held-out evaluations")
    bx.set(xlabel="RL step", ylabel="mean reward of the step's samples", ylim=(0, 1.02), title="training reward")
    cx.set(xlabel="seconds since the loop's start", ylabel="mean reward of the step's samples", ylim=(0, 1.02),
           title="training reward over wall time")
    dx.set(xlabel="RL step", ylabel="fraction of trained tokens", title="clip fractions: high (up), low (down)")
    dx.axhline(0, color="k", lw=0.5)
    for x in (bx, cx):
        if target is not None:
            x.axhline(target, color="k", lw=0.6, ls="--")
    for x in (ax, bx, cx, dx):
        x.legend(fontsize=6)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def median_beyond(xs: list) -> float | None:
    """The median of ``xs`` with None (not reached) above every number; None where that is the median."""
    m = statistics.median([float("inf") if x is None else x for x in xs])
    return None if m == float("inf") else m


def pooled(runs: list[dict], key: str) -> dict:
    """Median, mean and the share of nonzero values of a per-step clip figure over every step of ``runs``."""
    xs = [x for r in runs for x in r["clip"][key] if x is not None]
    if not xs:
        return {"median": None, "mean": None, "nonzero_steps": None, "steps": 0}
    return {"median": statistics.median(xs), "mean": statistics.fmean(xs),
            "nonzero_steps": sum(x > 0 for x in xs) / len(xs), "steps": len(xs)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="countdown", help="a conf/experiment/ preset; 'default': the default run")
    ap.add_argument("--name", default=None, help="the report's name after mrl_train_ (default: recipe_<recipe>)")
    ap.add_argument("--target", type=float, default=None,
                    help="steps, samples and seconds until the training reward's trailing mean first reaches this")
    ap.add_argument("--target-window", type=int, default=5, help="steps in that trailing mean")
    ap.add_argument("--group", default=None, metavar="NAME=KEY",
                    help="steps to --target by the value of override KEY in each variant (steps_to_<T%%>_by_<NAME>)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1])
    ap.add_argument("--set", nargs="*", default=[], help="overrides for every run")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME:OVERRIDE[,OVERRIDE...] (repeatable); none: one variant, 'default'")
    ap.add_argument("--eval-set", default="heldout", help="the evaluation set the figures are read from")
    ap.add_argument("--parallel", type=int, default=1, help="runs side by side (on a GPU host)")
    ap.add_argument("--stagger", type=float, default=0.0,
                    help="seconds between the starts of runs side by side: engines sharing a GPU size their memory "
                         "from what is free, and two sizing it at once overcommit it")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--note", default=None, help="recorded in the report as is (e.g. the statistic fixed before the "
                    "runs)")
    ap.add_argument("--keep", default=None, help="a folder to keep the run directories and logs in")
    ap.add_argument("--reuse", action="store_true",
                    help="a run whose directory under --keep holds a finished run is read instead of run again (its "
                         "process wall time where an earlier call recorded it, else null)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    variants = [(v.split(":", 1)[0], [o for o in v.split(":", 1)[1].split(",") if o]) for v in a.variant] \
        or [("default", [])]
    tmp = a.keep or tempfile.mkdtemp(prefix="mrl-recipe-")
    os.makedirs(tmp, exist_ok=True)
    sets = [*a.set, *make_models(a.set, tmp)]
    jobs = [(v, s) for s in a.seeds for v in variants]
    with ThreadPoolExecutor(max_workers=a.parallel) as pool:
        runs = list(pool.map(lambda ij: run_one(a.recipe, ij[1][0], ij[1][1], sets,
                                                os.path.join(tmp, f"{ij[1][0][0]}_s{ij[1][1]}"), a.eval_set, a.timeout,
                                                delay=(ij[0] % a.parallel) * a.stagger if ij[0] < a.parallel else 0.0,
                                                target=a.target, window=a.target_window, reuse=a.reuse),
                             enumerate(jobs)))
    summary = {}
    for name, _ in variants:
        mine = [r for r in runs if r["variant"] == name]
        lifts = [r["heldout_pass_at_1_end"] - r["heldout_pass_at_1_start"] for r in mine]
        summary[name] = {"lift": lifts, "lift_median": statistics.median(lifts),
                         "wall_seconds": [r["wall_seconds"] for r in mine],
                         "heldout_pass_at_1_start": [r["heldout_pass_at_1_start"] for r in mine],
                         "heldout_pass_at_1_end": [r["heldout_pass_at_1_end"] for r in mine],
                         **{f"{k}_pooled": pooled(mine, k) for k in mine[0]["clip"]},
                         "clip_frac_high_median": pooled(mine, "clip_frac_high")["median"],
                         "clip_frac_low_median": pooled(mine, "clip_frac_low")["median"]}
        if a.target is not None:
            for k in ("steps", "samples", "rollouts", "seconds"):
                summary[name][f"{k}_to_target"] = [r[f"{k}_to_target"] for r in mine]
                summary[name][f"{k}_to_target_median"] = median_beyond(summary[name][f"{k}_to_target"])
    extra = {"note": a.note} if a.note else {}
    if a.target is not None:
        extra["target"] = {"reward_trailing_mean": a.target, "window_steps": a.target_window}
        if a.group:
            gname, _, key = a.group.partition("=")
            by = {}
            for vname, overrides in variants:
                value = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == key), None)
                if value is None:
                    raise SystemExit(f"--group {a.group}: variant {vname!r} does not set {key}")
                by[value] = summary[vname]["steps_to_target"]
            extra[f"steps_to_{round(100 * a.target)}_by_{gname}"] = by
    name = f"mrl_train_{a.name or 'recipe_' + a.recipe}_{slug(device_name())}"
    out = a.out or os.path.join(REPORTS, "learning", f"{time.strftime('%Y-%m-%d', time.gmtime())}_{name}.json")
    what = "the default run" if a.recipe == "default" else f"+experiment={a.recipe}"
    plot(runs, out.removesuffix(".json") + ".png", f"{what} {' '.join(a.set)} on {device_name()}", a.target)
    dump({"recipe": a.recipe, "sets": a.set, "eval_set": a.eval_set, **extra, "summary": summary, "runs": runs},
         out, name=f"mrl_train_{a.name or 'recipe_' + a.recipe}_{slug(device_name())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
