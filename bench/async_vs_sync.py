"""Async (overlap) vs sync RL loop throughput on long-tailed response lengths, in one run.

    .venv/bin/python bench/async_vs_sync.py [--steps 40] [--rounds 3] [--out REPORT.json]

(the report goes to bench/reports/loop/<date>_async_vs_sync_cpu.json without --out)

A JSONL prompt set whose per-sample budgets are long-tailed (``LENGTH_MIX``: most 8 tokens, 5% run to
256; ``ignore_eos``, so lengths are exactly the budgets) is trained with the real loop in both modes:
``train.mode=sync`` (each step waits for its slowest sample, the engine idles meanwhile; weights synced
after every step; its engine never holds more than the step's 32 samples, on every core) and
``train.mode=overlap`` (the engine, on core 0, keeps generating up to ``max_inflight_groups`` groups;
batches fill with whatever finishes first, older samples are corrected by the IS weights; weights synced
every ``--sync-every`` steps: each sync pauses the engine, aborts what is in flight and re-prefills it
afterwards). A third run, ``_generation_ceiling.py``, is the overlap run's rollout side with the trainer
taken out (no training, pauses or syncs): the most any loop could train per second on this box, so it
tells how much of a gap to the goal is the loop's and how much the engine's. The three run in rounds,
interleaved, so a drift of the box's speed hits all of them. Reported: trained response tokens per second
of RL wall time pooled over the rounds, the ratio (pooled and per round), and the staleness distribution
of the overlap runs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

from _bench_common import dump

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MRL = os.path.join(os.path.dirname(sys.executable), "mrl")
EXTRA: list[str] = []  # more overrides for every run (--extra)


LENGTH_MIX = ((0.80, 8), (0.15, 32), (0.05, 256))
"""Per-sample response budget: probability, tokens (mean 24, cap 10.7x the mean). Drawn for each sample of
each group independently: the long ones are a few samples of many groups, not whole groups, as in
reasoning RL, where a batch almost always holds a response that runs to the cap."""


def write_prompts(path: str, n: int, group_size: int = 4, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    budgets = []
    with open(path, "w") as f:
        for i in range(n):
            row = []
            for _ in range(group_size):
                u, acc = rng.random(), 0.0
                for p, tokens in LENGTH_MIX:
                    acc += p
                    if u < acc:
                        break
                row.append(tokens)
            budgets += row
            f.write(json.dumps({"id": f"p{i}", "prompt": f"rev {i}=", "answer": "x", "max_new_tokens": row}) + "\n")
    return budgets


def overrides(mode: str, prompts: str, run_dir: str, steps: int, engine_batch: int, engine_cpus: str | None,
              inflight: int, sync_every: int = 1) -> list[str]:
    args = [f"train.mode={mode}", f"weight_sync.every_n_steps={sync_every if mode == 'overlap' else 1}",
            f"train.steps={steps}", "data=jsonl", f"data.path={prompts}",
            "train.eval_every=0", "train.sft_warmup_steps=0", "train.prompts_per_step=8",
            "rollout.n_samples_per_prompt=4",
            "rollout.ignore_eos=true", "train.max_staleness=4", "train.stale_policy=keep",
            f"train.max_inflight_groups={inflight}", "train.routing_metrics_every=0",
            f"rollout.max_running_requests={engine_batch}", "+rollout.server_args.max_total_tokens=16384", *EXTRA,
            f"run_dir={run_dir}"]
    return args + ([f"rollout.cpus=[{engine_cpus}]"] if engine_cpus else [])


def ceiling(prompts: str, run_dir: str, steps: int, engine_batch: int, engine_cpus: str | None, inflight: int) -> dict:
    """The overlap run's rollout side alone (``_generation_ceiling.py``): no training, no pauses, no syncs."""
    out = os.path.join(run_dir, "ceiling.json")
    p = subprocess.run([sys.executable, os.path.join(REPO, "bench", "_generation_ceiling.py"), "--steps", str(steps),
                        "--out", out,
                        *overrides("overlap", prompts, run_dir, steps, engine_batch, engine_cpus, inflight)],
                       cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"generation ceiling failed:\n{p.stderr[-3000:]}")
    return dict(json.load(open(out)), engine_cpus=engine_cpus or "all")


def run(mode: str, prompts: str, run_dir: str, steps: int, engine_batch: int, engine_cpus: str | None,
        inflight: int, sync_every: int = 1) -> dict:
    args = [MRL, "train", *overrides(mode, prompts, run_dir, steps, engine_batch, engine_cpus, inflight, sync_every)]
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
    med = lambda k: sorted(r.get(k, 0.0) for r in timed)[len(timed) // 2]  # noqa: E731
    return {"mode": mode, "engine_cpus": engine_cpus or "all",
            "sync_every_n_steps": sync_every if mode == "overlap" else 1,
            "median_seconds": {k: med(k) for k in ("step_seconds", "wait_seconds", "train_seconds", "drain_seconds",
                                                   "sync_seconds")},
            "steps_timed": len(timed), "seconds": seconds,
            "tokens": tokens, "sync_seconds_mean": sum(r.get("sync_seconds", 0.0) for r in timed) / len(timed),
            "wait_seconds_mean": sum(r["wait_seconds"] for r in timed) / len(timed),
            "tokens_per_s": tokens / seconds, "mean_response_len": tokens / (len(timed) * 32),
            "staleness_hist": last.get("staleness_hist", {}), "dropped_stale": last.get("dropped_stale", 0)}


def pooled(rs: list[dict]) -> float:
    return sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds of (sync, overlap, generation only), interleaved so that a drift of the box's "
                    "speed (15%% over minutes on a shared box) hits every mode alike")
    ap.add_argument("--engine-batch", type=int, default=64, help="rollout.max_running_requests (sync mode never "
                    "has more than one batch, 32 samples, in flight)")
    ap.add_argument("--inflight", type=int, default=32, help="train.max_inflight_groups of the overlap run")
    ap.add_argument("--sync-every", type=int, default=3,
                    help="weight_sync.every_n_steps of the overlap run (sync mode syncs after every step)")
    ap.add_argument("--split-cores", default="0",
                    help="rollout.cpus of the overlap run (the trainer takes the other cores); '' = shared")
    ap.add_argument("--variants", action="store_true",
                    help="in round 1 also: sync with the engine on the overlap run's cores only")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    split = a.split_cores or None
    # The baseline gets its best layout: sync mode never generates and trains at once, so its engine uses
    # every core (with --variants also the overlap run's split, which has always been slower).
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        prompts = os.path.join(tmp, "prompts.jsonl")
        budgets = write_prompts(prompts, 600)

        def go(tag: str, mode: str, cpus: str | None) -> dict:
            return run(mode, prompts, os.path.join(tmp, tag), a.steps, a.engine_batch, cpus, a.inflight, a.sync_every)

        for i in range(a.rounds):
            sync = go(f"sync{i}", "sync", None)
            over = go(f"overlap{i}", "overlap", split)
            top = ceiling(prompts, os.path.join(tmp, f"ceiling{i}"), a.steps, a.engine_batch, split, a.inflight)
            extra = [go("sync_split", "sync", split)] if a.variants and i == 0 else []
            rounds.append({"sync": sync, "overlap": over, "generation_only": top, "variants": extra,
                           "overlap_over_sync": over["tokens_per_s"] / sync["tokens_per_s"],
                           "generation_only_over_sync": top["tokens_per_s"] / sync["tokens_per_s"]})
            print(f"round {i + 1}: sync {sync['tokens_per_s']:.0f} tokens/s, overlap {over['tokens_per_s']:.0f}, "
                  f"generation only {top['tokens_per_s']:.0f}: overlap/sync {rounds[-1]['overlap_over_sync']:.2f}x",
                  flush=True)
    syncs, overs, tops = ([r[k] for r in rounds] for k in ("sync", "overlap", "generation_only"))
    ratios = sorted(r["overlap_over_sync"] for r in rounds)
    stale: dict[str, int] = {}
    for o in overs:
        for k, n in o["staleness_hist"].items():
            stale[k] = stale.get(k, 0) + n
    out = {"setup": "1 SGLang CPU engine + 1 trainer rank (tiny model, fp32)",
           "engine_batch": a.engine_batch, "max_inflight_groups": a.inflight,
           "overlap_sync_every_n_steps": a.sync_every, "steps": a.steps,
           "budget_mix": {b: budgets.count(b) for b in sorted(set(budgets))}, "rounds": rounds,
           "sync_tokens_per_s": pooled(syncs), "overlap_tokens_per_s": pooled(overs),
           "generation_only_tokens_per_s": pooled(tops),
           "overlap_over_sync": pooled(overs) / pooled(syncs),
           "overlap_over_sync_per_round": {"min": ratios[0], "median": ratios[len(ratios) // 2], "max": ratios[-1]},
           "generation_only_over_sync": pooled(tops) / pooled(syncs),
           "overlap_over_generation_only": pooled(overs) / pooled(tops), "staleness_hist": stale}
    print(f"{'mode':16s} {'tokens/s':>9s} {'mean len':>9s} {'wait/step':>9s} {'sync/step':>9s}   (pooled over "
          f"{a.rounds} rounds of {a.steps} steps)")
    for name, rs in (("sync", syncs), ("overlap", overs)):
        print(f"{name:16s} {pooled(rs):9.1f} {sum(r['mean_response_len'] for r in rs) / len(rs):9.1f} "
              f"{sum(r['wait_seconds_mean'] for r in rs) / len(rs):9.3f} "
              f"{sum(r['sync_seconds_mean'] for r in rs) / len(rs):9.3f}")
    print(f"{'generation only':16s} {pooled(tops):9.1f}   (no training, no pauses, no syncs: the most any loop "
          "could train per second here)")
    for v in rounds[0]["variants"]:
        print(f"variant: {v['mode']} engine cores {v['engine_cpus']}: {v['tokens_per_s']:.1f} tokens/s")
    print(f"overlap / sync: {out['overlap_over_sync']:.2f}x pooled, per round min {ratios[0]:.2f} median "
          f"{ratios[len(ratios) // 2]:.2f} max {ratios[-1]:.2f}; generation only / sync: "
          f"{out['generation_only_over_sync']:.2f}x; overlap reaches {out['overlap_over_generation_only']:.0%} of "
          f"generation only; staleness (versions behind, samples): {stale}")
    dump(out, a.out, name="async_vs_sync_cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
