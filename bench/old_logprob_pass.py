"""What pi_old's forward pass costs: ``Policy.rl_step`` with ``algo.old_logprobs=recompute`` (a forward-only pass
over every mini-batch but the first before the first optimizer step) against ``engine`` (no pass), the same
mini-batches, micro-batches, replayed routes and optimizer steps otherwise, in one process.

    python bench/old_logprob_pass.py [--preset tiny] [--samples 32] [--seq 96] [--mini-batches 4] [--pairs 10]
                                     [--micro-batch-size 4] [--json PATH]
    # one GPU: the Qwen3-30B-A3B shape cut to 8 layers, bf16 weights and Adam states (Transformer Engine)
    python bench/old_logprob_pass.py --shape qwen3_30b_a3b --layers 8 --samples 32 --seq 2048 \\
        --micro-batch-size 1 --pairs 8 --model-dir /tmp/models

``--old-micro-batch-size N`` adds a third side to every pair: the pass in micro-batches of N
(``algo.old_logprob_micro_batch_size``; a forward keeps no activations for a backward, so it can take larger
ones than training), reported as ``old_logprob_pass_vs_step_own``.

Paired A/B: each pair runs both sides back to back on the same batch (the order alternates), so the box's
drift hits both; the figure is the median over the pairs of recompute / engine - 1 (``old_logprob_pass_vs_step``:
the pass's time as a share of the RL step without it). Both sides take ``--mini-batches`` optimizer steps with
``algo.correction=none`` (the engine side cannot have a correction), so the difference is the pass alone. One
rank (gloo on CPU, NCCL on a GPU); on CPU the ratio, not the seconds, is the figure (a forward is about a third of
forward + backward, and the pass covers (M - 1) / M of the batch).

``--shape`` (a ``bench/_random_checkpoint.py`` shape, cut to ``--layers``) instead of ``--preset``: a random
checkpoint of that shape, written tensor by tensor (kept in ``--model-dir``). On a GPU the weights are bf16 and
Adam's states ``--optimizer-states`` (bf16 by default: Transformer Engine's FusedAdam); before the model is built,
the trainer's model states (``mrl.megatron.memory``) plus ``--headroom-gib`` for activations and workspaces must fit
the GPU, or the run stops naming the largest ``--layers`` that would. The report records the peak of allocated
GPU memory.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _bench_common import device_name, dump, make_model, slug  # noqa: E402
from _random_checkpoint import SHAPES, config, make_checkpoint  # noqa: E402


def state_gib(kw: dict, dtype: str, states: str) -> float:
    """GiB of the trainer's model states (weights, fp32 grads, Adam's states) for Qwen3-MoE shape ``kw`` on one
    rank, from its config alone."""
    from mrl.config.load import compose
    from mrl.config.schema import DType
    from mrl.megatron.memory import model_state_bytes
    from mrl.models import get_bridge

    pcfg = compose([]).parallel
    with tempfile.TemporaryDirectory() as tmp:
        config(kw).save_pretrained(tmp)
        bridge = get_bridge(tmp)
        est = model_state_bytes(bridge, pcfg, dtype=DType(dtype), optimizer_states_dtype=DType(states),
                                padded_vocab=bridge.padded_vocab(compose([]).model.vocab_divisible_by, pcfg.tp))
    return est["total_bytes"] / 2**30


def check_fits(a, kw: dict, total_gib: float) -> dict:
    """The model states of ``kw`` plus ``--headroom-gib`` within ``total_gib``, or a SystemExit naming the
    largest layer count that fits."""
    need = state_gib(kw, a.dtype, a.optimizer_states)
    if need + a.headroom_gib <= total_gib:
        return {"model_states_gib": need, "headroom_gib": a.headroom_gib, "gpu_gib": total_gib}
    n = next((n for n in range(kw["num_hidden_layers"] - 1, 0, -1)
              if state_gib(dict(kw, num_hidden_layers=n), a.dtype, a.optimizer_states) + a.headroom_gib
              <= total_gib), 0)
    raise SystemExit(f"--shape {a.shape} --layers {kw['num_hidden_layers']}: the trainer's model states take about "
                     f"{need:.1f} GiB (weights {a.dtype}, Adam states {a.optimizer_states}); with --headroom-gib "
                     f"{a.headroom_gib:g} that is more than this GPU's {total_gib:.1f} GiB: --layers {n} fits"
                     + ("" if a.optimizer_states == "bf16" else ", or --optimizer-states bf16"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny", help="a tiny preset (tiny, stress_a, stress_b) or a bench shape")
    ap.add_argument("--shape", default=None, choices=list(SHAPES),
                    help="instead of --preset: a random Qwen3-MoE checkpoint of this shape (_random_checkpoint.py)")
    ap.add_argument("--layers", type=int, default=None, help="cut --shape to this many layers (default: all)")
    ap.add_argument("--model-dir", default=None, help="where the --shape checkpoint is written and kept (default: a "
                    "temporary folder)")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="model.dtype (default: bf16 GPU, fp32 CPU)")
    ap.add_argument("--optimizer-states", choices=["bf16", "fp32"], default=None,
                    help="train.optimizer_states_dtype (default: bf16 GPU, needs Transformer Engine; fp32 CPU)")
    ap.add_argument("--headroom-gib", type=float, default=10.0,
                    help="GPU memory kept beside the model states for activations, workspaces and allocator slack")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq", type=int, default=96, help="tokens per sample (a quarter prompt)")
    ap.add_argument("--mini-batches", type=int, default=4)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--old-micro-batch-size", type=int, default=None,
                    help="also time the pass in micro-batches of this size (algo.old_logprob_micro_batch_size) in "
                         "every pair: a third side, reported as old_logprob_pass_vs_step_own")
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.pairs < 8:
        ap.error("--pairs: at least 8 (the figure is a median of paired ratios)")
    if a.layers is not None and a.shape is None:
        ap.error("--layers cuts a --shape")

    import numpy as np
    import torch

    gpu = torch.cuda.is_available()
    a.dtype = a.dtype or ("bf16" if gpu else "fp32")
    a.optimizer_states = a.optimizer_states or ("bf16" if gpu else "fp32")
    if gpu and a.optimizer_states == "bf16" and importlib.util.find_spec("transformer_engine") is None:
        raise SystemExit("--optimizer-states bf16 (the default on a GPU) needs Transformer Engine's FusedAdam, which "
                         "does not import here: put TE on the path, or --optimizer-states fp32 with fewer --layers")
    memory = None
    if a.shape is not None:
        kw = dict(SHAPES[a.shape], **({"num_hidden_layers": a.layers} if a.layers else {}))
        a.layers = kw["num_hidden_layers"]
        if gpu:
            memory = check_fits(a, kw, torch.cuda.get_device_properties(0).total_memory / 2**30)

    from mrl.config.load import compose
    from mrl.config.schema import OldLogprobs
    from mrl.megatron.batch import RLBatch
    from mrl.megatron.parallel import init_parallel
    from mrl.megatron.policy import Policy
    from tests.conftest import one_rank_gloo_world

    load_before = os.getloadavg()  # a loaded box widens the spread of the pairs: reported with them
    with tempfile.TemporaryDirectory() as tmp, one_rank_gloo_world():  # the env of a one-rank world; NCCL where CUDA is
        if a.shape is None:
            hf = make_model(os.path.join(tmp, "model"), a.preset)
        else:
            t = time.perf_counter()
            hf = make_checkpoint(os.path.join(a.model_dir or tmp, f"model_{a.shape}_l{a.layers}"), a.shape, a.layers)
            print(f"[bench] checkpoint {hf}: {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
        cfg = compose([f"model.hf_path={hf}", "model.make_tiny_if_missing=false", f"model.dtype={a.dtype}",
                       f"train.optimizer_states_dtype={a.optimizer_states}", "algo.correction=none",
                       f"algo.mini_batches={a.mini_batches}", f"train.micro_batch_size={a.micro_batch_size}",
                       "train.packing=false", "algo.lr=1e-6"])
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

        own = a.old_micro_batch_size

        def step(side: OldLogprobs, size: int | None = None) -> float:
            policy.cfg.algo.old_logprobs, policy.cfg.algo.old_logprob_micro_batch_size = side, size
            if gpu:
                torch.cuda.synchronize()
            t = time.perf_counter()
            policy.rl_step(batch, float(a.samples))
            if gpu:
                torch.cuda.synchronize()
            return time.perf_counter() - t

        sides = {"engine": (OldLogprobs.engine, None), "recompute": (OldLogprobs.recompute, None),
                 **({"recompute_own": (OldLogprobs.recompute, own)} if own else {})}
        for _ in range(a.warmup):
            for side in sides.values():
                step(*side)
        pairs = []
        for k in range(a.pairs):
            order = list(sides) if k % 2 == 0 else list(reversed(sides))
            got = {name: step(*sides[name]) for name in order}
            pairs.append({f"{name}_s": got[name] for name in sides} | {"first": order[0]})
        torch.distributed.barrier()
    ratios = [p["recompute_s"] / p["engine_s"] - 1.0 for p in pairs]
    q = statistics.quantiles(ratios, n=4)
    own_figures = {}
    if own:
        r_own = [p["recompute_own_s"] / p["engine_s"] - 1.0 for p in pairs]
        q_own = statistics.quantiles(r_own, n=4)
        own_figures = {"old_logprob_pass_vs_step_own": statistics.median(r_own), "ratio_own_p25": q_own[0],
                       "ratio_own_p75": q_own[2], "own_over_recompute": statistics.median(
                           p["recompute_own_s"] / p["recompute_s"] for p in pairs),
                       "recompute_own_median_s": statistics.median(p["recompute_own_s"] for p in pairs)}
    result = {"bench": "old_logprob_pass", "args": vars(a), "pairs": pairs,
              "old_logprob_pass_vs_step": statistics.median(ratios), "ratio_p25": q[0], "ratio_p75": q[2],
              "engine_median_s": statistics.median(p["engine_s"] for p in pairs),
              "recompute_median_s": statistics.median(p["recompute_s"] for p in pairs), **own_figures,
              "pass_covers": (a.mini_batches - 1) / a.mini_batches,
              "tokens_per_step": a.samples * a.seq,
              "model": {"shape": a.shape, "layers": a.layers} if a.shape else {"preset": a.preset},
              "dtype": a.dtype, "optimizer_states": a.optimizer_states, "memory": memory,
              "max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu else None,
              "load_average": {"before": load_before, "after": os.getloadavg()}}
    print(f"pi_old's pass over {a.mini_batches - 1} of {a.mini_batches} mini-batches: "
          f"{100 * result['old_logprob_pass_vs_step']:.1f}% of the RL step without it "
          f"(median of {a.pairs} pairs, p25-p75 {100 * q[0]:.1f}-{100 * q[2]:.1f}%)")
    if own:
        print(f"pi_old's pass in micro-batches of {own}: {100 * own_figures['old_logprob_pass_vs_step_own']:.1f}% "
              f"(p25-p75 {100 * own_figures['ratio_own_p25']:.1f}-{100 * own_figures['ratio_own_p75']:.1f}%)")
    what = f"_{a.shape}_l{a.layers}" if a.shape else ""
    dump(result, a.json, name=f"old_logprob_pass{what}{'_' + slug(device_name()) if gpu else ''}")


if __name__ == "__main__":
    main()
