"""Paired A/B of one expert bucket's replayed load on the engine side (``mrl.engine.server.replayed_load``): the
recorded copies as one ``_foreach_copy_`` per step (what replays did before copies were merged) against
``LoadPlan.replay`` (contiguous pairs fused, one tensor of every expert merged into one copy).

    python bench/replay_merge_bench.py --device cuda --tp 2 --reverse --out DIR     # Qwen3-30B-A3B experts
    python bench/replay_merge_bench.py --device cpu --hidden 256 --inter 128 --experts 64 --out DIR

The load is SGLang's fused-MoE one at engine TP rank ``--tp - 1`` (``FusedMoE._load_w13`` / ``_load_w2``:
gate and up rows narrowed into ``w13[e]``, ``down_proj`` columns narrowed into ``w2[e]``), recorded once
with ``record_load``; ``--reverse`` lists the experts backwards, as megatron's parameter buffer holds them
(in-place buckets). Both arms must leave bitwise the same weights as the model's own load; each repetition
times both, alternating, and the report holds every repetition and the per-repetition ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mrl.engine.server.replayed_load import bucket_views, record_load  # noqa: E402


class Experts(torch.nn.Module):
    def __init__(self, a, device):
        super().__init__()
        self.a, half = a, a.inter // a.tp
        kw = dict(dtype=torch.bfloat16, device=device)
        self.w13 = torch.nn.Parameter(torch.zeros(a.experts, 2 * half, a.hidden, **kw), requires_grad=False)
        self.w2 = torch.nn.Parameter(torch.zeros(a.experts, a.hidden, half, **kw), requires_grad=False)

    def load_weights(self, weights):
        a, rank = self.a, self.a.tp - 1
        half = a.inter // a.tp
        for name, w in weights:
            e, part = int(name.split(".")[1]), name.split(".")[2]
            if part == "down":
                self.w2.data[e].copy_(w.narrow(1, rank * half, half))
            else:
                self.w13.data[e].narrow(0, 0 if part == "gate" else half, half).copy_(w.narrow(0, rank * half, half))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768, help="moe_intermediate_size (before TP)")
    ap.add_argument("--experts", type=int, default=128, help="experts in the bucket (one layer's)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--reverse", action="store_true", help="experts listed backwards (megatron's buffer order)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dev = torch.device(a.device)
    order = range(a.experts - 1, -1, -1) if a.reverse else range(a.experts)
    full = {"gate": (a.inter, a.hidden), "up": (a.inter, a.hidden), "down": (a.hidden, a.inter)}
    meta = [(f"e.{e}.{p}", full[p]) for e in order for p in ("down", "gate", "up")]
    names, dtypes, shapes = [n for n, _ in meta], ["bfloat16"] * len(meta), [list(s) for _, s in meta]
    n = sum(torch.Size(s).numel() for s in shapes)

    def bucket(seed):
        g = torch.Generator(device=dev).manual_seed(seed)
        return torch.randn(n, generator=g, device=dev).to(torch.bfloat16).view(torch.uint8)

    m, ref = Experts(a, dev), Experts(a, dev)
    flat = bucket(0)
    plan, why = record_load(lambda: m.load_weights(bucket_views(flat, names, dtypes, shapes)), flat, m)
    if plan is None:
        raise SystemExit(f"not replayable: {why}")

    def unmerged(flat):
        st = flat.untyped_storage()
        base = torch.empty(0, dtype=torch.bfloat16, device=dev).set_(st, 0, (st.nbytes() // 2,), (1,))
        for dsts, what in plan.steps:
            torch._foreach_copy_(dsts, [base.as_strided(size, stride, off) for _, off, size, stride in what])

    flat = bucket(1)
    ref.load_weights(bucket_views(flat, names, dtypes, shapes))
    for arm in (unmerged, plan.replay):
        m.w13.data.zero_(), m.w2.data.zero_()
        arm(flat)
        if not (torch.equal(m.w13, ref.w13) and torch.equal(m.w2, ref.w2)):
            raise SystemExit(f"{arm.__name__}: not bitwise equal to the model's own load")

    def timed(fn) -> tuple[float, float]:
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn(flat)
        host = time.perf_counter() - t
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return host, time.perf_counter() - t

    runs = []
    for rep in range(a.reps + 2):
        pair = (unmerged, plan.replay) if rep % 2 == 0 else (plan.replay, unmerged)
        r = {f.__name__: timed(f) for f in pair}
        if rep >= 2:  # two warm-up pairs
            runs.append({"before_host_s": r["unmerged"][0], "before_s": r["unmerged"][1],
                         "after_host_s": r["replay"][0], "after_s": r["replay"][1]})
    ratio = [x["after_s"] / x["before_s"] for x in runs]
    med = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
    report = {"bench": "replay_merge", "args": vars(a), "bytes": n * 2, "torch": torch.__version__,
              "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
              "counts": plan.counts(), "recorded_steps": len(plan.steps), "median": med,
              "after_vs_before_median": statistics.median(ratio), "after_vs_before_min": min(ratio),
              "after_vs_before_max": max(ratio), "runs": runs, "bitwise_equal": True}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "replay_merge.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"[replay_merge] {a.experts} experts, tp{a.tp}, {'reversed' if a.reverse else 'in order'}, "
          f"{n * 2 / 1e6:.0f} MB: counts {plan.counts()}; before {med['before_s'] * 1e3:.3f} ms "
          f"(host {med['before_host_s'] * 1e3:.3f}), after {med['after_s'] * 1e3:.3f} ms "
          f"(host {med['after_host_s'] * 1e3:.3f}); after/before median {report['after_vs_before_median']:.3f} "
          f"({min(ratio):.3f}-{max(ratio):.3f}); bitwise equal", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
