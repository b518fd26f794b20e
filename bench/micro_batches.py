"""The host's work of building a step's micro-batches (``Policy.micro_batches``: token, mask, logprob
and route tensors per micro-batch, packed), timed at the GPU benchmark's shape. On a GPU this runs at
the start of every RL step while the device waits, so its seconds count in full.

    python bench/micro_batches.py [--samples 16] [--seq 4096] [--layers 12] [--top-k 8] [--experts 128]
                                  [--dp 2] [--micro-batch-size 4] [--reps 15] [--json PATH]

No model is built: the method reads only the train config, the layout's DP/TP sizes and the routes
codec's expert count and top-k, which are given here. Packing uses the THD layout the GPU path uses
(its host side needs no Transformer Engine kernel). Samples are random tokens with a quarter prompt
and uint8 routes, as the engine sends them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from types import SimpleNamespace

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _bench_common import dump  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    import mrl.megatron.packing as packing
    from mrl.config.schema import Config, TrainConfig
    from mrl.megatron.policy import Policy, RLBatch

    packing.HAVE_TE = True  # the GPU path's THD layout
    rng = np.random.default_rng(0)
    prompt = a.seq // 4
    batch = RLBatch(tokens=[rng.integers(0, 151936, size=a.seq).tolist() for _ in range(a.samples)],
                    prompt_lens=[prompt] * a.samples,
                    behav_logp=[(-2.0 - rng.random(a.seq - prompt)).tolist() for _ in range(a.samples)],
                    advantages=rng.standard_normal(a.samples).tolist(),
                    routes=[rng.integers(0, a.experts, size=(a.seq - 1, a.layers, a.top_k)).astype(np.uint8)
                            for _ in range(a.samples)])
    policy = Policy.__new__(Policy)  # the method's inputs only (see the module docstring)
    policy.cfg = Config(train=TrainConfig(micro_batch_size=a.micro_batch_size, packing=True))
    policy.layout = SimpleNamespace(dp=SimpleNamespace(size=a.dp, rank=0), tp=SimpleNamespace(size=1))
    policy.codec = SimpleNamespace(num_experts=a.experts, top_k=a.top_k)
    policy.support_spec = None
    policy.micro_batches(batch, True)  # warm-up
    ms = []
    for _ in range(a.reps):
        t = time.perf_counter()
        policy.micro_batches(batch, True)
        ms.append((time.perf_counter() - t) * 1e3)
    q = statistics.quantiles(ms, n=4)
    result = {"bench": "micro_batches", "args": vars(a), "ms": ms, "median_ms": statistics.median(ms),
              "p25_ms": q[0], "p75_ms": q[2], "min_ms": min(ms), "max_ms": max(ms)}
    print(f"micro-batches of one DP rank ({a.samples // a.dp} samples of {a.seq} tokens): "
          f"{result['median_ms']:.1f} ms (p25-p75 {q[0]:.1f}-{q[2]:.1f})")
    dump(result, a.json, name="micro_batches")


if __name__ == "__main__":
    main()
