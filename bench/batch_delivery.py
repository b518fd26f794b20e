"""A step's batch from rank 0 to the trainer ranks: the whole batch as one pickled object to every rank
(``broadcast_object``) against each rank's DP share as one flat buffer (``BatchScatter``).

    python bench/batch_delivery.py                 # 2 ranks, dp=2: gloo on CPU, NCCL where CUDA is
    python bench/batch_delivery.py --reps 12 --samples 256 --layers 48 --top-k 8

The batch is synthesized at a production shape (no model): ``--samples`` samples, prompts of 256-512
tokens, responses long-tailed (log-normal, median ``--response-median``) up to ``--response-max`` tokens,
engine logprobs, uint8 routes ``[n - 1, layers, top_k]``. First every rank checks that the share it
received is exactly its DP rank's samples. Each repetition times both paths, in
alternating order, on every rank from a barrier to the rank holding its batch (rebuilt Python objects,
as the trainer gets them); a step's time is the slowest rank's. Bytes: what each rank receives (rank 0
is the source and receives nothing): the pickled batch, or the pickled header plus its share's buffer.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def synth_batch(a, seed: int = 0):
    import numpy as np

    from mrl.megatron.batch import RLBatch

    g = np.random.default_rng(seed)
    prompts = g.integers(256, 513, a.samples)
    responses = np.clip(np.round(g.lognormal(np.log(a.response_median), 0.9, a.samples)), 16, a.response_max)
    tokens, behav, routes = [], [], []
    for p, r in zip(prompts.tolist(), responses.astype(int).tolist()):
        tokens.append(g.integers(0, 151_936, p + r).tolist())
        behav.append((-g.exponential(0.5, r)).tolist())
        routes.append(g.integers(0, 128, (p + r - 1, a.layers, a.top_k), dtype=np.uint8))
    batch = RLBatch(tokens=tokens, prompt_lens=prompts.tolist(), behav_logp=behav,
                    advantages=g.normal(size=a.samples).tolist(), routes=routes)
    return batch, float(responses.sum()), {"reward": 0.5, "response_len": float(responses.mean())}


def check_share(got, whole, dp: int, dp_rank: int) -> None:
    """The delivered share is exactly this DP rank's samples of the batch (every rank synthesizes the same)."""
    import numpy as np

    from mrl.megatron.batch import dp_share

    mine = dp_share(len(whole), dp, dp_rank)
    for name in ("tokens", "prompt_lens", "behav_logp", "advantages"):
        assert getattr(got, name) == getattr(whole, name)[mine.start:mine.stop], name
    assert got.first == mine.start and all(a.dtype == np.uint8 and np.array_equal(a, b)
                                           for a, b in zip(got.routes, whole.routes[mine.start:mine.stop]))


def worker(a) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from mrl.megatron.batch import dp_share
    from mrl.megatron.batch_scatter import BatchScatter, layout, make_header
    from mrl.megatron.collectives import broadcast_object

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=600))
    me, world = dist.get_rank(), dist.get_world_size()
    dp_rank = me * a.dp // world  # consecutive ranks share a DP rank, as TP peers do
    item = synth_batch(a) if me == 0 else None
    scatter = BatchScatter(dp_rank=dp_rank, dp_size=a.dp, group=dist.group.WORLD)
    check_share(scatter.deliver(item, what="the checked batch")[0], synth_batch(a)[0], a.dp, dp_rank)

    def old():
        return broadcast_object(item, what="the bench batch")[0]

    def new():
        return scatter.deliver(item, what="the bench batch")[0]

    runs = {"broadcast_object": [], "scatter": []}
    for rep in range(a.warmup + a.reps):
        for name in (("broadcast_object", "scatter") if rep % 2 == 0 else ("scatter", "broadcast_object")):
            dist.barrier()
            t0 = time.perf_counter()
            got = (old if name == "broadcast_object" else new)()
            seconds = time.perf_counter() - t0
            assert len(got) == (a.samples if name == "broadcast_object" else a.samples // a.dp)
            del got
            if rep >= a.warmup:
                runs[name].append(seconds)
    times = [None] * world
    dist.all_gather_object(times, runs)
    if me == 0:
        batch, normalizer, info = item
        header = make_header(batch, normalizer, info, a.dp)
        whole = len(pickle.dumps(item))
        share_bytes = [layout(header, dp_share(a.samples, a.dp, world_rank * a.dp // world))[1]
                       for world_rank in range(world)]
        out = {"backend": dist.get_backend(), "world": world, "dp": a.dp, "per_rank_seconds": times,
               "bytes_received": {
                   "broadcast_object": [0] + [whole] * (world - 1),
                   "scatter": [0] + [len(pickle.dumps(header)) + share_bytes[w] for w in range(1, world)]},
               "header_bytes": len(pickle.dumps(header)), "share_buffer_bytes": share_bytes,
               "batch": {"samples": a.samples, "tokens": sum(len(t) for t in batch.tokens),
                         "routes_bytes": sum(r.nbytes for r in batch.routes),
                         "longest": max(len(t) for t in batch.tokens)}}
        with open(a.out, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


def summary(xs: list[float]) -> dict:
    q = statistics.quantiles(xs, n=4)
    return {"median": statistics.median(xs), "p25": q[0], "p75": q[2], "min": min(xs), "max": max(xs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--response-median", type=int, default=700)
    ap.add_argument("--response-max", type=int, default=2048)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--json", default=None,
                    help="report path (default: bench/reports/rl_step/<date>_batch_delivery_<hw>.json)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    if a.reps < 8:
        raise SystemExit(f"--reps {a.reps}: at least 8 repetitions for a median with its spread")
    from _bench_common import device_name, dump, slug

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items()
                 if k not in ("json", "worker", "out", "nproc")]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.nproc}",
               os.path.abspath(__file__), "--worker", f"--out={out}", *flags]
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                   PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3000)
        if r.returncode:
            print(r.stdout[-3000:], r.stderr[-6000:], sep="\n")
            raise SystemExit(f"the workers failed ({r.returncode})")
        with open(out) as f:
            res = json.load(f)
    per_rank = res.pop("per_rank_seconds")
    steps = {k: [max(rank[k][i] for rank in per_rank) for i in range(a.reps)] for k in per_rank[0]}
    result = {"bench": "batch_delivery", "shape": {k: getattr(a, k) for k in (
        "samples", "layers", "top_k", "response_median", "response_max")} | res.pop("batch"),
              "reps": a.reps, "warmup": a.warmup, **res,
              "step_seconds": {k: summary(v) for k, v in steps.items()},
              "step_seconds_runs": steps, "per_rank_seconds_runs": per_rank,
              "ratio_scatter_vs_broadcast": summary([s / b for s, b in zip(steps["scatter"],
                                                                             steps["broadcast_object"])])}
    for k, s in result["step_seconds"].items():
        got = result["bytes_received"][k][1:]
        print(f"{k}: {s['median']:.3f} s per step (p25-p75 {s['p25']:.3f}-{s['p75']:.3f}), "
              f"received per rank {[round(b / 2**20, 1) for b in got]} MiB", file=sys.stderr)
    dump(result, a.json, name=f"batch_delivery_{slug(device_name())}")


if __name__ == "__main__":
    main()
