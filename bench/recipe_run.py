"""A recipe's learning, measured: ``mrl train +experiment=<recipe>`` once per variant and seed, its held-out
evaluations over the steps (``train.eval_sets``: greedy pass@1 and sampled pass@k), the reward, the wall time
and the mismatch split, in one report with a plot.

    .venv/bin/python bench/recipe_run.py --recipe countdown --seeds 1 2 3
    python3 bench/recipe_run.py --recipe countdown --seeds 1 --parallel 2 \\
        --set model=small_gpu engine=gpu weight_sync.transport=tensor engine.base_gpu_id=0 \\
        engine.mem_fraction_static=0.25 --variant replay_on:train.replay=true --variant replay_off:train.replay=false

(without --out the report goes to bench/reports/learning/<date>_mrl_train_recipe_<recipe>_<hardware>.json, the
plot beside it). Per run: the evaluations of the first set (``eval/<set>/...`` rows of ``metrics.jsonl``), of
which ``heldout_pass_at_1_start`` (the evaluation before the first RL step, after the warm start) and
``heldout_pass_at_1_end`` (the last one) are the sampled pass@1, or the greedy one where the set samples
nothing; the reward of the first and last 10 steps; the medians of the mismatch split (``mismatch/*``) and of
the step. The summary gives, per variant, the lift (end - start) of every run and its median.
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


def summarize(rows: list[dict], set_name: str) -> dict:
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
        "median_step_seconds": median_of(steps[1:], "step_seconds"),
        "mismatch_split_median": {k: median_of(steps, k) for k in mismatch},
        "warm_start_nll_last": next((r["sft/nll"] for r in reversed(rows) if "sft/nll" in r), None),
    }


def run_one(recipe: str, variant: tuple[str, list[str]], seed: int, sets: list[str], run_dir: str,
            set_name: str, timeout: float, delay: float = 0.0, save_hf: bool = False) -> dict:
    name, overrides = variant
    time.sleep(delay)
    cmd = [*mrl_command(), "train", f"+experiment={recipe}", f"run_dir={run_dir}", f"seed={seed}",
           f"train.save_hf={str(save_hf).lower()}", *sets, *overrides]
    t0 = time.monotonic()
    with open(run_dir + ".log", "w") as log:
        p = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=log,
                           stderr=subprocess.STDOUT, timeout=timeout)
    wall = time.monotonic() - t0
    if p.returncode:
        tail = open(run_dir + ".log").read()[-3000:]
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{tail}")
    rows = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
    got = summarize(rows, set_name)
    print(f"[bench] {name} seed {seed}: pass@1 {got['heldout_pass_at_1_start']:.3f} -> "
          f"{got['heldout_pass_at_1_end']:.3f}, wall {wall:.0f} s", file=sys.stderr, flush=True)
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


def plot(runs: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in runs:
        label = f"{r['variant']} s{r['seed']}"
        steps = [e["step"] for e in r["evaluations"]]
        line = ax.plot(steps, [pass_at_1(e) for e in r["evaluations"]], marker="o", label=f"{label} pass@1")[0]
        greedy = [e.get("greedy_pass_at_1") for e in r["evaluations"]]
        if any(g is not None for g in greedy):
            ax.plot(steps, greedy, ls="--", color=line.get_color(), label=f"{label} greedy")
        ks = sorted({k for e in r["evaluations"] for k in e if k.startswith("pass_at_") and k != "pass_at_1"})
        for k in ks[-1:]:
            ax.plot(steps, [e.get(k) for e in r["evaluations"]], ls=":", color=line.get_color(),
                    label=f"{label} {k.replace('_at_', '@')}")
        bx.plot(range(1, len(r["rewards"]) + 1), r["rewards"], color=line.get_color(), alpha=0.7, label=label)
    ax.set(xlabel="RL step (0: after the warm start)", ylabel="held-out", ylim=(0, 1), title="held-out evaluations")
    bx.set(xlabel="RL step", ylabel="mean reward of the step's samples", ylim=(0, 1), title="training reward")
    ax.legend(fontsize=7)
    bx.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="countdown", help="a conf/experiment/ preset")
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
    ap.add_argument("--keep", default=None, help="a folder to keep the run directories and logs in")
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
                                                delay=(ij[0] % a.parallel) * a.stagger if ij[0] < a.parallel else 0.0),
                             enumerate(jobs)))
    summary = {}
    for name, _ in variants:
        mine = [r for r in runs if r["variant"] == name]
        lifts = [r["heldout_pass_at_1_end"] - r["heldout_pass_at_1_start"] for r in mine]
        summary[name] = {"lift": lifts, "lift_median": statistics.median(lifts),
                         "wall_seconds": [r["wall_seconds"] for r in mine],
                         "heldout_pass_at_1_start": [r["heldout_pass_at_1_start"] for r in mine],
                         "heldout_pass_at_1_end": [r["heldout_pass_at_1_end"] for r in mine]}
    name = f"mrl_train_recipe_{a.recipe}_{slug(device_name())}"
    out = a.out or os.path.join(REPORTS, "learning", f"{time.strftime('%Y-%m-%d', time.gmtime())}_{name}.json")
    plot(runs, out.removesuffix(".json") + ".png", f"+experiment={a.recipe} on {device_name()}")
    dump({"recipe": a.recipe, "sets": a.set, "eval_set": a.eval_set, "summary": summary, "runs": runs}, out,
         name=f"mrl_train_recipe_{a.recipe}_{slug(device_name())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
