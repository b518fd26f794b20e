"""Async (overlap) vs sync RL loop throughput on long-tailed response lengths, in one run.

    .venv/bin/python bench/async_vs_sync.py [--steps 12] [--out docs/results/async_vs_sync_cpu.json]

A JSONL prompt set whose per-row budgets are long-tailed (most 8 tokens, a few 160, ``ignore_eos``,
so lengths are exactly the budgets) is trained with the real loop twice: ``train.mode=sync`` (each
step waits for its slowest sample, the engine idles meanwhile) and ``train.mode=overlap`` (the engine
keeps generating up to ``max_inflight_groups`` groups; batches fill with whatever finishes first,
older samples are corrected by the IS weights). Reported: trained response tokens per second of RL
wall time, the ratio, and the staleness distribution of the overlap run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MRL = os.path.join(os.path.dirname(sys.executable), "mrl")


def write_prompts(path: str, n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    budgets = []
    with open(path, "w") as f:
        for i in range(n):
            u = rng.random()
            budget = 160 if u < 0.06 else (48 if u < 0.2 else 8)  # long tail: 6% of prompts 20x longer
            budgets.append(budget)
            f.write(json.dumps({"id": f"p{i}", "prompt": f"rev {i}=", "answer": "x", "max_new_tokens": budget}) + "\n")
    return budgets


def run(mode: str, prompts: str, run_dir: str, steps: int, engine_batch: int, engine_cpus: str | None,
        inflight: int) -> dict:
    args = [MRL, "train", f"train.mode={mode}", f"train.steps={steps}", "data=jsonl", f"data.path={prompts}",
            "train.eval_every=0", "train.sft_warmup_steps=0", "train.prompts_per_step=8", "rollout.n_samples_per_prompt=4",
            "rollout.ignore_eos=true", "train.max_staleness=4", "train.stale_policy=keep",
            f"train.max_inflight_groups={inflight}", "train.routing_metrics_every=0",
            f"rollout.max_running_requests={engine_batch}", "+rollout.server_args.max_total_tokens=16384",
            f"run_dir={run_dir}"]
    if engine_cpus:
        args.append(f"rollout.cpus=[{engine_cpus}]")
    p = subprocess.run(args, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"mrl train ({mode}) failed:\n{p.stderr[-3000:]}")
    rows = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps_rows = [r for r in rows if "step_seconds" in r]
    # the first step includes engine warm-up and the first fill of the pipeline in both modes
    timed = steps_rows[1:]
    seconds = sum(r["step_seconds"] for r in timed)
    tokens = sum(r["response_len"] * 8 * 4 for r in timed)
    last = steps_rows[-1]
    return {"mode": mode, "engine_cpus": engine_cpus or "all", "steps_timed": len(timed), "seconds": seconds,
            "tokens": tokens, "sync_seconds_mean": sum(r.get("sync_seconds", 0.0) for r in timed) / len(timed),
            "wait_seconds_mean": sum(r["wait_seconds"] for r in timed) / len(timed),
            "tokens_per_s": tokens / seconds, "mean_response_len": tokens / (len(timed) * 32),
            "staleness_hist": last.get("staleness_hist", {}), "dropped_stale": last.get("dropped_stale", 0)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--engine-batch", type=int, default=32, help="rollout.max_running_requests")
    ap.add_argument("--inflight", type=int, default=None,
                    help="train.max_inflight_groups of the overlap run (default: 2 engine batches of groups)")
    ap.add_argument("--split-cores", default="0",
                    help="rollout.cpus of the overlap run (the trainer takes the other cores); '' = shared")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    # The baseline gets its best layout: sync mode never generates and trains at once, so its engine may
    # use every core. Both splits are run for sync, the faster one is the baseline.
    variants = [("sync", None), ("sync", a.split_cores or None), ("overlap", a.split_cores or None)]
    with tempfile.TemporaryDirectory() as tmp:
        prompts = os.path.join(tmp, "prompts.jsonl")
        budgets = write_prompts(prompts, 400)
        inflight = a.inflight or 2 * a.engine_batch // 4
        runs = [run(m, prompts, os.path.join(tmp, f"{m}{i}"), a.steps, a.engine_batch, c, inflight)
                for i, (m, c) in enumerate(dict.fromkeys(variants))]
    sync = max((r for r in runs if r["mode"] == "sync"), key=lambda r: r["tokens_per_s"])
    over = next(r for r in runs if r["mode"] == "overlap")
    ratio = over["tokens_per_s"] / sync["tokens_per_s"]
    out = {"hardware": "2-core x86 CPU box, 1 SGLang CPU engine + 1 trainer rank (tiny model, fp32)",
           "engine_batch": a.engine_batch, "max_inflight_groups": inflight, "budget_mix": {b: budgets.count(b) for b in sorted(set(budgets))},
           "runs": runs, "baseline": sync, "overlap": over, "overlap_over_sync": ratio}
    print(f"{'mode':8s} {'engine cores':>12s} {'tokens/s':>9s} {'mean len':>9s} {'wait/step':>9s} {'sync/step':>9s}")
    for r in runs:
        print(f"{r['mode']:8s} {r['engine_cpus']:>12s} {r['tokens_per_s']:9.1f} {r['mean_response_len']:9.1f} "
              f"{r['wait_seconds_mean']:9.3f} {r['sync_seconds_mean']:9.3f}")
    print(f"overlap / best sync throughput: {ratio:.2f}x; staleness (versions behind, samples): "
          f"{over['staleness_hist']}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
