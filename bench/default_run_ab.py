"""The default run (`mrl train`) with two sets of overrides, A and B, run in turn (A B A B ...): where a step's
time goes and what a setting buys, on a box whose speed drifts.

    .venv/bin/python bench/default_run_ab.py --steps 30 --rounds 3 --a engine.cpu_threads=2 --b ''
    .venv/bin/python bench/default_run_ab.py --steps 150 --rounds 3 --a '' --only-a   # the whole default run

(``--set`` adds overrides to both sides: a GPU run's, ``scripts/gpu/recipe_export.sh`` with ``EVAL=1``; without
--out the report goes to bench/reports/learning/<date>_mrl_train_default_ab_cpu.json)

Per run: the whole process's wall and CPU time (its processes' user + system seconds: on a shared box the
figure other jobs move least), the loop's (first RL step to the last), the median (p25-p75) of the step
phases from ``metrics.jsonl`` (``step_seconds`` and the loop's phases, ``mrl.trainer.phases``: wait for
rollouts, routing diagnostics, train, drain, sync, verify, log, eval, checkpoint, other; ``rest``: the step
less the named phases, which is ``other``), the staleness of the trained samples, the reward of the first
and last 10 steps, the last held-out accuracy and every evaluation's result (``eval/<set>/...``: the step
and weight versions it measured, its pass rates, how long it generated). Per round: B / A of the wall time
and of the median step. The first RL step is left out of the medians (it fills the pipeline).

    # what evaluation beside training costs the steps (docs/evaluation.md): eval off (A) vs sampled pass@k on (B)
    .venv/bin/python bench/default_run_ab.py --steps 60 --rounds 2 --name eval_overhead_cpu --a train.eval_every=0 \
        --b 'train.eval_every=10 train.eval_sets.0.n=8 train.eval_sets.0.k=[1,4,8]'
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import subprocess
import sys
import tempfile
import time

from _bench_common import dump
from recipe_run import mrl_command
from mrl.trainer.phases import PHASES as LOOP_PHASES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ("step_seconds", *(f"{p}_seconds" for p in LOOP_PHASES))


def quartiles(xs: list[float]) -> dict:
    xs = sorted(xs)
    n = len(xs)
    return {"median": xs[n // 2], "p25": xs[n // 4], "p75": xs[(3 * n) // 4]} if n else {}


def run(overrides: list[str], steps: int, run_dir: str) -> dict:
    t0, before = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    p = subprocess.run([*mrl_command(), "train", f"run_dir={run_dir}", f"train.steps={steps}", *overrides], cwd=REPO,
                       env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the job's processes that were waited for
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if p.returncode:
        raise RuntimeError(f"mrl train {overrides} failed:\n{p.stderr[-3000:]}")
    rows = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps_rows = [r for r in rows if "step_seconds" in r]
    timed = steps_rows[1:]
    rest = [r["step_seconds"] - sum(r.get(k, 0.0) for k in PHASES[1:]) for r in timed]
    rewards = [r["reward"] for r in steps_rows]
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    results = [r for r in rows if any(k.startswith("eval/") and k.endswith("/version") for k in r)]
    stale = steps_rows[-1].get("staleness_hist", {})
    return {"overrides": overrides, "wall_seconds": wall, "cpu_seconds": cpu,
            "loop_seconds": steps_rows[-1]["wall_seconds"],
            "phases": {k: quartiles([r.get(k, 0.0) for r in timed]) for k in PHASES} | {"rest": quartiles(rest)},
            "reward_first10": sum(rewards[:10]) / len(rewards[:10]),
            "reward_last10": sum(rewards[-10:]) / len(rewards[-10:]), "reward_last": rewards[-1],
            "eval_first": evals[0] if evals else None, "eval_last": evals[-1] if evals else None,
            "staleness_hist": stale, "step_seconds_all": [r["step_seconds"] for r in steps_rows],
            "evaluations": results}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--a", default="", help="overrides of A, one shell-quoted string ('' = the default run)")
    ap.add_argument("--b", default="", help="overrides of B")
    ap.add_argument("--set", default="", help="overrides of both sides, before each side's own (a GPU run's engine "
                    "and model keys, say)")
    ap.add_argument("--only-a", action="store_true", help="run A alone, --rounds times")
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="default_ab_cpu", help="the report's file name: <date>_mrl_train_<name>.json")
    a = ap.parse_args()
    common = shlex.split(a.set)
    sides = {"A": common + shlex.split(a.a)} | ({} if a.only_a else {"B": common + shlex.split(a.b)})
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.rounds):
            got = {}
            for name, ov in sides.items():
                got[name] = run(ov, a.steps, os.path.join(tmp, f"{name}{i}"))
                r = got[name]
                print(f"[bench] round {i} {name}: wall {r['wall_seconds']:.1f} s, cpu {r['cpu_seconds']:.0f} s, "
                      f"loop {r['loop_seconds']:.1f} s, "
                      f"median step {r['phases']['step_seconds']['median']:.3f} s, reward last 10 "
                      f"{r['reward_last10']:.3f}", file=sys.stderr, flush=True)
            if "B" in got:
                got["B_over_A"] = {
                    "wall": got["B"]["wall_seconds"] / got["A"]["wall_seconds"],
                    "cpu": got["B"]["cpu_seconds"] / got["A"]["cpu_seconds"],
                    "median_step": (got["B"]["phases"]["step_seconds"]["median"]
                                    / got["A"]["phases"]["step_seconds"]["median"])}
            rounds.append(got)
    summary = {name: {"wall_seconds": quartiles([r[name]["wall_seconds"] for r in rounds]),
                      "cpu_seconds": quartiles([r[name]["cpu_seconds"] for r in rounds]),
                      "median_step": quartiles([r[name]["phases"]["step_seconds"]["median"] for r in rounds])}
               for name in sides}
    if "B" in sides:
        summary["B_over_A"] = {k: quartiles([r["B_over_A"][k] for r in rounds]) for k in ("wall", "cpu", "median_step")}
    dump({"steps": a.steps, "sides": sides, "summary": summary, "rounds": rounds}, a.out, name=f"mrl_train_{a.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
