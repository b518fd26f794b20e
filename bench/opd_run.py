"""On-policy distillation against GRPO alone, measured: a teacher trained by mrl on a recipe's task and exported
as a Hugging Face checkpoint distils into fresh students (the recipe's random init and warm start), which are
compared with students trained by the recipe's GRPO alone: same seeds, steps and batch, held-out accuracy over
the steps from the run's own evaluation (``train.eval_sets``).

    .venv/bin/python bench/opd_run.py --seeds 2 3 --steps 200 --eval-every 20            # trains its teacher
    .venv/bin/python bench/opd_run.py --teacher-run runs/countdown --seeds 2 3 --steps 200 # a run of the recipe

The teacher: ``--teacher DIR`` (an HF checkpoint), ``--teacher-run RUN_DIR`` (an ``mrl train`` run of the
recipe: its ``hf/final``, else ``mrl export`` of its newest checkpoint; its held-out figures from its metrics),
or, with neither, ``mrl train +experiment=<recipe> train.save_hf=true`` for ``--teacher-steps`` steps.

The statistic, fixed before the runs: held-out accuracy is the evaluation's sampled pass@1 (the recipe's
headline figure, ``recipe_run.pass_at_1``). Per seed, the target is the GRPO student's final evaluation; a
run's steps to target are the first evaluation step at or above its seed's target (never: none), GRPO's own
included (at most its last step). An arm's figure is the median over seeds, a run that never reaches its
target counting as never. The goal: OPD's steps to target at most half of GRPO's. The training seconds to
target (the step times up to it) are reported beside.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from _bench_common import REPORTS, device_name, dump, slug
from recipe_run import REPO, eval_rows, make_models, mrl_command, pass_at_1, run_one, summarize


def steps_to(run: dict, target: float) -> int | None:
    """The first evaluation step whose held-out accuracy reaches ``target``."""
    return next((e["step"] for e in run["evaluations"] if (pass_at_1(e) or 0.0) >= target), None)


def seconds_to(run: dict, step: int | None) -> float | None:
    """Training seconds up to ``step``: the sum of the step times (the warm start, common to both arms, left out)."""
    return None if step is None else sum(run["step_seconds"][:step])


def arm_median(xs: list[float | None]) -> float | None:
    """Median over seeds; a run that never reached the target counts as never."""
    m = statistics.median(math.inf if x is None else x for x in xs)
    return None if math.isinf(m) else m


def teacher_from_run(run_dir: str, dest: str, base: list[str], eval_set: str) -> tuple[str, dict]:
    """The HF checkpoint of an ``mrl train`` run (``hf/final``, else ``mrl export`` of its newest checkpoint to
    ``dest``) and its held-out figures."""
    rows = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
    got = summarize(rows, eval_set)
    hf = os.path.join(run_dir, "hf", "final")
    if not os.path.exists(os.path.join(hf, "config.json")):
        hf = dest
        if not os.path.exists(os.path.join(hf, "config.json")):
            extra = [f"--hf={base[0].split('=', 1)[1]}"] if base else []
            subprocess.run([*mrl_command(), "export", run_dir, hf, *extra], cwd=REPO, check=True,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
    return hf, {"run_dir": run_dir, "heldout_pass_at_1_end": got["heldout_pass_at_1_end"],
                "heldout_greedy_pass_at_1_end": got["heldout_greedy_pass_at_1_end"],
                "rl_steps": len(got["rewards"])}


def run_or_reuse(recipe: str, arm: tuple[str, list[str]], seed: int, sets: list[str], run_dir: str, set_name: str,
                 timeout: float, steps: int) -> dict:
    """``recipe_run.run_one``, or a finished run of the same name kept from before (``--keep``): its figures are
    read back, the wall time from its log's and config's modification times."""
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(metrics):
        rows = [json.loads(x) for x in open(metrics)]
        if max((r["step"] for r in rows if "step_seconds" in r), default=0) >= steps:
            wall = os.path.getmtime(run_dir + ".log") - os.path.getmtime(os.path.join(run_dir, "config.yaml"))
            print(f"[bench] {arm[0]} seed {seed}: kept run {run_dir}", file=sys.stderr, flush=True)
            return {"variant": arm[0], "seed": seed, "overrides": arm[1], "wall_seconds": wall, "reused": True,
                    **summarize(rows, set_name)}
    return run_one(recipe, arm, seed, sets, run_dir, set_name, timeout)


def extra_run(spec: str, set_name: str) -> dict:
    """A run outside the statistic (``--extra NAME=RUN_DIR``): its seed, learning rate and teacher, and what it
    logged."""
    name, _, run_dir = spec.partition("=")
    rows = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in rows if "step_seconds" in r]
    import yaml

    cfg = yaml.safe_load(open(os.path.join(run_dir, "config.yaml")))
    return {"variant": name, "run_dir": run_dir, "seed": cfg["seed"], "algo_lr": cfg["algo"]["lr"],
            "teacher": cfg["scoring"]["teacher"]["hf_path"], "steps_planned": cfg["train"]["steps"],
            "steps_done": len(steps),
            "rewards": [r.get("reward") for r in steps], "evaluations": eval_rows(rows, set_name)}


def plot(runs: list[dict], targets: dict[int, float], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {}
    for r in runs:
        c = colors.setdefault(r["variant"], f"C{len(colors)}")
        ls = ["-", "--", ":", "-."][sorted({x["seed"] for x in runs}).index(r["seed"]) % 4]
        ax.plot([e["step"] for e in r["evaluations"]], [pass_at_1(e) for e in r["evaluations"]], marker="o", ms=3,
                color=c, ls=ls, label=f"{r['variant']} s{r['seed']}")
        ys = r["token_rewards"] if r["variant"].startswith("opd") else r["rewards"]
        bx.plot(range(1, len(ys) + 1), ys, color=c, ls=ls, alpha=0.7,
                label=f"{r['variant']} s{r['seed']} {'token_reward' if r['variant'].startswith('opd') else 'reward'}")
    seeds = sorted({x["seed"] for x in runs})
    for s, t in sorted(targets.items()):
        ax.axhline(t, color="k", lw=0.8, ls=["-", "--", ":", "-."][seeds.index(s) % 4], label=f"target s{s} {t:.3f}")
    ax.set(xlabel="RL step (0: after the warm start)", ylabel="held-out sampled pass@1", ylim=(0, 1),
           title="held-out evaluations")
    bx.set(xlabel="RL step", title="GRPO: mean task reward; OPD: mean teacher - student logprob")
    ax.legend(fontsize=7)
    bx.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="countdown", help="a conf/experiment/ preset")
    ap.add_argument("--seeds", type=int, nargs="+", default=[2])
    ap.add_argument("--steps", type=int, default=200, help="RL steps of every student")
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--teacher", default=None, help="the teacher's HF checkpoint")
    ap.add_argument("--teacher-run", default=None, help="an mrl train run of the recipe to take the teacher from")
    ap.add_argument("--teacher-steps", type=int, default=300, help="RL steps of a teacher this script trains")
    ap.add_argument("--teacher-seed", type=int, default=1)
    ap.add_argument("--set", nargs="*", default=[], help="overrides for every run, the teacher's included")
    ap.add_argument("--opd-set", nargs="*", default=[], help="overrides of the OPD arm (scoring.teacher.coef=...)")
    ap.add_argument("--variant", action="append", default=[],
                    help="more arms: NAME:OVERRIDE[,OVERRIDE...]; {teacher} is replaced by the teacher's path")
    ap.add_argument("--eval-set", default="heldout")
    ap.add_argument("--parallel", type=int, default=2, help="runs side by side: a seed's arms together")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--keep", default=None, help="a folder to keep the run directories and logs in (a finished run "
                    "found there is read back, not run again)")
    ap.add_argument("--extra", action="append", default=[], metavar="NAME=RUN_DIR",
                    help="a run outside the statistic (a control, possibly stopped early), reported as 'extra_runs': "
                         "its overrides, evaluations and steps done")
    ap.add_argument("--note", default=None, help="recorded in the report as is (the box's load, what changed)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    tmp = a.keep or tempfile.mkdtemp(prefix="mrl-opd-")
    os.makedirs(tmp, exist_ok=True)
    base = make_models(a.set, tmp)
    sets = [*a.set, *base]
    if a.teacher:
        teacher, teacher_info = a.teacher, {"hf_path": a.teacher}
    else:
        run_dir = a.teacher_run
        if run_dir is None:
            run_dir = os.path.join(tmp, "teacher")
            run_one(a.recipe, ("teacher", [f"train.steps={a.teacher_steps}"]), a.teacher_seed, sets, run_dir,
                    a.eval_set, a.timeout, save_hf=True)
        teacher, teacher_info = teacher_from_run(run_dir, os.path.join(tmp, "teacher_hf"), base, a.eval_set)
    print(f"[bench] teacher {teacher}: {teacher_info}", file=sys.stderr, flush=True)
    student = [f"train.steps={a.steps}", f"train.eval_every={a.eval_every}"]
    arms = [("grpo", student),
            ("opd", [*student, "scoring=opd", f"scoring.teacher.hf_path={teacher}", *a.opd_set])]
    for v in a.variant:
        name, _, spec = v.partition(":")
        arms.append((name, [*student, *(o.replace("{teacher}", teacher) for o in spec.split(",") if o)]))
    jobs = [(arm, s) for s in a.seeds for arm in arms]
    with ThreadPoolExecutor(max_workers=a.parallel) as pool:
        runs = list(pool.map(lambda j: run_or_reuse(a.recipe, j[0], j[1], sets, os.path.join(tmp, f"{j[0][0]}_s{j[1]}"),
                                                    a.eval_set, a.timeout, a.steps), jobs))
    for r in runs:  # the step rows again, for the token rewards and step times summarize() leaves out
        rows = [json.loads(x) for x in open(os.path.join(tmp, f"{r['variant']}_s{r['seed']}", "metrics.jsonl"))]
        steps = [x for x in rows if "step_seconds" in x]
        r["step_seconds"] = [x["step_seconds"] for x in steps]
        r["token_rewards"] = [x.get("token_reward", 0.0) for x in steps]
    targets = {r["seed"]: r["heldout_pass_at_1_end"] for r in runs if r["variant"] == "grpo"}
    target = statistics.median(targets.values())
    summary = {}
    for name, _ in arms:
        mine = [r for r in runs if r["variant"] == name]
        for r in mine:
            r["target"] = targets[r["seed"]]
            r["steps_to_target"] = steps_to(r, r["target"])
            r["train_seconds_to_target"] = seconds_to(r, r["steps_to_target"])
        summary[name] = {"seeds": [r["seed"] for r in mine],
                         "steps_to_target": [r["steps_to_target"] for r in mine],
                         "steps_to_target_median": arm_median([r["steps_to_target"] for r in mine]),
                         "train_seconds_to_target": [r["train_seconds_to_target"] for r in mine],
                         "train_seconds_to_target_median": arm_median([r["train_seconds_to_target"] for r in mine]),
                         "heldout_pass_at_1_start": [r["heldout_pass_at_1_start"] for r in mine],
                         "heldout_pass_at_1_end": [r["heldout_pass_at_1_end"] for r in mine],
                         "median_step_seconds": [r["median_step_seconds"] for r in mine],
                         "wall_seconds": [r["wall_seconds"] for r in mine]}
    opd, grpo = summary["opd"]["steps_to_target_median"], summary["grpo"]["steps_to_target_median"]
    result = {
        **({"note": a.note} if a.note else {}),
        "bench": "opd_learning", "recipe": a.recipe, "sets": a.set, "eval_set": a.eval_set,
        "statistic": "held-out sampled pass@1; per seed, target = the GRPO run's final evaluation, steps to target "
                     "= a run's first evaluation step at or above it; an arm's figure: median over seeds (a run "
                     "that never reaches its target counts as never: null)",
        "teacher": {"hf_path": teacher, **teacher_info}, "opd_overrides": arms[1][1][len(student):],
        "steps": a.steps, "eval_every": a.eval_every, "seeds": a.seeds,
        "target_heldout_pass_at_1": target, "target_per_seed": targets,
        "opd_steps_to_target": opd, "grpo_steps_to_target": grpo,
        "opd_over_grpo_steps": None if opd is None or not grpo else opd / grpo,
        "goal_met": opd is not None and grpo is not None and opd <= grpo / 2,
        "summary": summary, "runs": runs, "extra_runs": [extra_run(x, a.eval_set) for x in a.extra],
    }
    name = f"mrl_train_opd_{a.recipe}_{slug(device_name())}"
    out = a.out or os.path.join(REPORTS, "learning", f"{time.strftime('%Y-%m-%d', time.gmtime())}_{name}.json")
    plot(runs, targets, out.removesuffix(".json") + ".png",
         f"+experiment={a.recipe}: OPD from an mrl-trained teacher vs GRPO alone, {device_name()}")
    dump(result, out, name=f"mrl_train_opd_{a.recipe}_{slug(device_name())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
