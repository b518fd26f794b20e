"""Context parallelism on long responses: ``Policy`` with ``parallel.cp=2`` against CP=1 on the same RL batch, the
same GPUs (``--cp`` of them) and the same expert parallelism (``--ep``, default 2: the Qwen3-30B-A3B slice's
trainer states do not fit one 80 GB GPU unsharded): CP2 x EP2 against DP2 x EP2. The Qwen3-30B-A3B slice (12
of its 48 layers) by default, bf16, Keep Routing on.

    python bench/cp2_vs_cp1.py --work /tmp/cp                     # 2 GPUs: 2 samples of 1k prompt + 16k response
    python bench/cp2_vs_cp1.py --work /tmp/cp --response 32768 --packing off
    python bench/cp2_vs_cp1.py --work /tmp/cp --check             # the plan and the argument checks only (any host)

The CP=1 run (``_cp_worker.py --mode reference``) makes the batch: random tokens, and as routes the
model's own natural routing, recorded, standing in for an engine's. The CP run loads that batch. Reported:
``max_abs_logprob_diff_vs_cp1`` (and the mean) over every response token of the replayed forward before any
update, ``route_agreement_replay_on`` (how often each MoE layer's own top-k, from the scores of the CP run's
replayed forward, equals the replayed experts: a route fed to the wrong token would make it chance; the CP=1
run's own figure alongside), the first RL step's loss against CP=1's, ``step_s`` (median ``Policy.rl_step``
after a warm-up step) and ``peak_memory_gib`` (the largest rank's) of both. The report's name contains
``cp2``.
"""

from __future__ import annotations

import argparse
import os
import sys

from _bench_common import HERE, dump, make_model, slug, torchrun

WORKER = "_cp_worker.py"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True, help="folder for the checkpoint, the batch and the workers' results")
    ap.add_argument("--hf", default=None, help="a Qwen3-MoE checkpoint (default: --preset made in --work)")
    ap.add_argument("--preset", default="qwen3_30b_a3b_l12")
    ap.add_argument("--cp", type=int, default=2, help="context-parallel size, and the GPUs both runs take")
    ap.add_argument("--ep", type=int, default=2, help="expert parallelism of both runs (divides --cp)")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--response", type=int, default=16384)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--packing", choices=["on", "off"], default="on")
    ap.add_argument("--steps", type=int, default=4, help="timed RL steps per side, the first a warm-up")
    ap.add_argument("--optimizer-states", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per worker")
    ap.add_argument("--out", default=None, help="report path (default: bench/reports/context_parallel/...)")
    ap.add_argument("--check", action="store_true", help="check the arguments and print the plan; run nothing")
    a = ap.parse_args(argv)
    if a.cp < 2:
        ap.error(f"--cp must be >= 2 (it is compared with CP=1), got {a.cp}")
    for key in ("samples", "prompt", "response", "micro_batch_size", "ep"):
        if getattr(a, key) < 1:
            ap.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(a, key)}")
    if a.cp % a.ep:
        ap.error(f"--ep {a.ep} must divide the {a.cp} GPUs of --cp {a.cp}")
    if a.samples % a.cp:
        ap.error(f"--samples {a.samples} must split over the reference's DP of {a.cp}")
    if a.steps < 2:
        ap.error(f"--steps must be >= 2 (the first is a warm-up), got {a.steps}")
    if a.out is not None and f"cp{a.cp}" not in os.path.basename(a.out):
        ap.error(f"--out {a.out}: the report's file name must contain 'cp{a.cp}'")
    return a


def worker_args(a: argparse.Namespace, hf: str, mode: str) -> list[str]:
    cp = 1 if mode == "reference" else a.cp
    return ["--hf", hf, "--mode", mode, "--cp", str(cp), "--ep", str(a.ep), "--batch", os.path.join(a.work, "batch.pt"),
            "--samples", str(a.samples), "--prompt", str(a.prompt), "--response", str(a.response),
            "--micro-batch-size", str(a.micro_batch_size), "--packing", a.packing, "--steps", str(a.steps),
            "--optimizer-states", a.optimizer_states, "--out", os.path.join(a.work, f"{mode}.json")]


def plan(a: argparse.Namespace, hf: str) -> list[tuple[int, list[str]]]:
    """(processes, worker arguments) of the two runs, CP=1 first; each worker checks its own arguments."""
    sys.path.insert(0, HERE)
    import _cp_worker

    out = []
    for mode, nproc in (("reference", a.cp), ("cp", a.cp)):
        args = worker_args(a, hf, mode)
        _cp_worker.parse_args(args)
        out.append((nproc, args))
    return out


def compare(a: argparse.Namespace, ref: dict, cp: dict, lp_ref: dict, lp_cp: dict) -> dict:
    """The report's figures from the two workers' results."""
    import torch

    if set(lp_ref) != set(lp_cp):
        raise SystemExit(f"the runs scored different samples: {sorted(lp_ref)} vs {sorted(lp_cp)}")
    diffs = torch.cat([(lp_cp[i] - lp_ref[i]).abs() for i in sorted(lp_ref)])
    loss = {k: {"cp1": ref["first_step"][k], f"cp{a.cp}": cp["first_step"][k],
                "abs_diff": abs(ref["first_step"][k] - cp["first_step"][k])}
            for k in ref["first_step"] if k in cp["first_step"]}
    return {"bench": "cp2_vs_cp1", "cp": a.cp, "ep": a.ep, "preset": a.preset, "samples": a.samples, "prompt": a.prompt,
            "response": a.response, "packing": a.packing, "micro_batch_size": a.micro_batch_size,
            "optimizer_states": a.optimizer_states,
            "max_abs_logprob_diff_vs_cp1": float(diffs.max()), "mean_abs_logprob_diff_vs_cp1": float(diffs.mean()),
            "response_tokens_compared": int(diffs.numel()),
            "route_agreement_replay_on": cp["route_agreement_replay_on"],
            "route_agreement_replay_on_cp1": ref["route_agreement_replay_on"],
            "first_step_vs_cp1": loss,
            "step_s": cp["step_s"], "step_s_cp1": ref["step_s"],
            "peak_memory_gib": cp["peak_memory_gib"], "peak_memory_gib_cp1": ref["peak_memory_gib"],
            "runs": {"cp1": ref, f"cp{a.cp}": cp}}


def main(argv=None) -> None:
    import json

    a = parse_args(argv)
    hf = a.hf or os.path.join(a.work, a.preset)
    runs = plan(a, hf)
    if a.check:
        for nproc, args in runs:
            print(f"torchrun --nproc-per-node={nproc} bench/{WORKER} {' '.join(args)}")
        return
    import torch

    if torch.cuda.device_count() < a.cp:
        raise SystemExit(f"--cp {a.cp} needs {a.cp} GPUs, this host has {torch.cuda.device_count()}")
    os.makedirs(a.work, exist_ok=True)
    if a.hf is None:
        make_model(hf, a.preset)
    for nproc, args in runs:
        torchrun(nproc, WORKER, args, timeout=a.timeout)
    res = {m: json.load(open(os.path.join(a.work, f"{m}.json"))) for m in ("reference", "cp")}
    lps = {m: torch.load(os.path.join(a.work, f"{m}.json.logprobs.pt")) for m in ("reference", "cp")}
    result = compare(a, res["reference"], res["cp"], lps["reference"], lps["cp"])
    from _bench_common import device_name

    dump(result, a.out, name=f"context_parallel_cp{a.cp}_vs_cp1_{a.preset}_{a.response // 1024}k_{slug(device_name())}")


if __name__ == "__main__":
    main()
