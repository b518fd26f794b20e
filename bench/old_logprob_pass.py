"""What pi_old's forward pass costs: ``Policy.rl_step`` with ``algo.old_logprobs=recompute`` (a forward-only pass
over every mini-batch but the first before the first optimizer step) against ``engine`` (no pass), the same
mini-batches, micro-batches, replayed routes and optimizer steps otherwise, in one process.

    python bench/old_logprob_pass.py [--preset tiny] [--samples 32] [--seq 96] [--mini-batches 4] [--pairs 10]
                                     [--micro-batch-size 4] [--json PATH]

Paired A/B: each pair runs both sides back to back on the same batch (the order alternates), so the box's
drift hits both; the figure is the median over the pairs of recompute / engine - 1 (``old_logprob_pass_vs_step``:
the pass's time as a share of the RL step without it). Both sides take ``--mini-batches`` optimizer steps with
``algo.correction=none`` (the engine side cannot have a correction), so the difference is the pass alone. One
rank, gloo; on CPU the ratio, not the seconds, is the figure (a forward is about a third of forward + backward,
and the pass covers (M - 1) / M of the batch).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _bench_common import dump, make_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny", help="a tiny preset (tiny, stress_a, stress_b) or a bench shape")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq", type=int, default=96, help="tokens per sample (a quarter prompt)")
    ap.add_argument("--mini-batches", type=int, default=4)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.pairs < 8:
        ap.error("--pairs: at least 8 (the figure is a median of paired ratios)")

    import numpy as np
    import torch

    from mrl.config.load import compose
    from mrl.config.schema import OldLogprobs
    from mrl.megatron.batch import RLBatch
    from mrl.megatron.parallel import init_parallel
    from mrl.megatron.policy import Policy
    from tests.conftest import one_rank_gloo_world

    load_before = os.getloadavg()  # a loaded box widens the spread of the pairs: reported with them
    with tempfile.TemporaryDirectory() as tmp, one_rank_gloo_world():
        hf = make_model(os.path.join(tmp, "model"), a.preset)
        cfg = compose([f"model.hf_path={hf}", "algo.correction=none", f"algo.mini_batches={a.mini_batches}",
                       f"train.micro_batch_size={a.micro_batch_size}", "train.packing=false", "algo.lr=1e-6"])
        policy = Policy(cfg, init_parallel(cfg.parallel, seed=cfg.seed), hf)
        c, vocab = policy.codec, policy.bridge.vocab_size
        rng = np.random.default_rng(0)
        prompt = a.seq // 4
        batch = RLBatch(tokens=[rng.integers(3, vocab, size=a.seq).tolist() for _ in range(a.samples)],
                        prompt_lens=[prompt] * a.samples,
                        behav_logp=[(-2.0 - rng.random(a.seq - prompt)).tolist() for _ in range(a.samples)],
                        advantages=rng.standard_normal(a.samples).tolist(),
                        routes=[np.stack([rng.permutation(c.num_experts)[:c.top_k]
                                          for _ in range((a.seq - 1) * len(c.moe_layers))])
                                .reshape(a.seq - 1, len(c.moe_layers), c.top_k).astype(np.uint8)
                                for _ in range(a.samples)])

        def step(side: OldLogprobs) -> float:
            policy.cfg.algo.old_logprobs = side
            t = time.perf_counter()
            policy.rl_step(batch, float(a.samples))
            return time.perf_counter() - t

        for _ in range(a.warmup):
            step(OldLogprobs.engine), step(OldLogprobs.recompute)
        pairs = []
        for k in range(a.pairs):
            order = (OldLogprobs.engine, OldLogprobs.recompute) if k % 2 == 0 else \
                (OldLogprobs.recompute, OldLogprobs.engine)
            got = {side: step(side) for side in order}
            pairs.append({"engine_s": got[OldLogprobs.engine], "recompute_s": got[OldLogprobs.recompute],
                          "first": order[0].value})
        torch.distributed.barrier()
    ratios = [p["recompute_s"] / p["engine_s"] - 1.0 for p in pairs]
    q = statistics.quantiles(ratios, n=4)
    result = {"bench": "old_logprob_pass", "args": vars(a), "pairs": pairs,
              "old_logprob_pass_vs_step": statistics.median(ratios), "ratio_p25": q[0], "ratio_p75": q[2],
              "engine_median_s": statistics.median(p["engine_s"] for p in pairs),
              "recompute_median_s": statistics.median(p["recompute_s"] for p in pairs),
              "pass_covers": (a.mini_batches - 1) / a.mini_batches,
              "load_average": {"before": load_before, "after": os.getloadavg()}}
    print(f"pi_old's pass over {a.mini_batches - 1} of {a.mini_batches} mini-batches: "
          f"{100 * result['old_logprob_pass_vs_step']:.1f}% of the RL step without it "
          f"(median of {a.pairs} pairs, p25-p75 {100 * q[0]:.1f}-{100 * q[2]:.1f}%)")
    dump(result, a.json, name="old_logprob_pass")


if __name__ == "__main__":
    main()
