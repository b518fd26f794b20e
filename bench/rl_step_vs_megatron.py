"""mrl's RL step against plain megatron-core's training step: same model shape, spec, layout, GPU and tokens.

    python bench/rl_step_vs_megatron.py --shape bench490 --layouts tp1             # one GPU
    python bench/rl_step_vs_megatron.py --shape qwen3_30b_a3b_l12 --optimizer-states bf16 --profile
    python bench/rl_step_vs_megatron.py --shape tiny --seq 64      # without CUDA: a debug run (gloo, fp32)

Baseline (``_megatron_step_worker.py``): megatron's own model, labels, schedule and optimizer step, no mrl
code. Measured (``_mrl_step_worker.py``): ``Policy.rl_step`` with replay and packing on. Both step the
optimizer once per ``--micro-batches`` rows of ``--seq`` tokens per DP rank. The two sides cannot share
one process (a 30B-class slice fits one GPU once), so they alternate by process in ABBA order over
``--rounds``; the ratio is reported of the medians over every timed step and per round (median of the
round's steps, paired with the other side's in the same round). Model TFLOP/s counts the matmuls of
attention (projections and the causal core), the routed and shared experts, router and LM head, forward
and backward (x3); MFU against the GPU's dense bf16 peak.
"""

import argparse
import json
import os
import shutil
import statistics
import tempfile

from _bench_common import device_name, dump, make_model, slug, torchrun

LAYOUTS = {"tp1": (1, []), "tp2": (2, ["--tp", "2"]), "ep2": (2, ["--ep", "2"])}
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0}  # dense bf16, SXM


def model_flops_per_token(hf: dict, seq: int) -> float:
    """Forward + backward matmul FLOPs per token (x3 of the forward's 2 per multiply-add)."""
    h, heads, kv, hd = hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    dense = set(hf.get("mlp_only_layers") or [])
    attn = 2 * h * (heads + 2 * kv) * hd + 2 * heads * hd * h
    core = 2 * 2 * seq * heads * hd / 2  # QK^T and PV over a causal mask: half the square on average
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    moe = 2 * h * experts + hf["num_experts_per_tok"] * 3 * 2 * h * hf["moe_intermediate_size"]
    mlp = 3 * 2 * h * hf["intermediate_size"]
    layers = sum(attn + core + (mlp if i in dense else moe) for i in range(hf["num_hidden_layers"]))
    return 3 * (layers + 2 * h * hf["vocab_size"])


def summary(steps: list[float]) -> dict:
    q = statistics.quantiles(steps, n=4) if len(steps) > 1 else [steps[0]] * 3
    return {"median": statistics.median(steps), "p25": q[0], "p75": q[2], "min": min(steps), "max": max(steps)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="bench490", help="bench490 | qwen3_30b_a3b_l12 | tiny (a _bench_common preset)")
    ap.add_argument("--hf", default=None, help="an existing Qwen3-MoE checkpoint instead of --shape")
    ap.add_argument("--layouts", nargs="+", default=["tp1"])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--micro-batch-size", type=int, default=1,
                    help="rows of --seq tokens per micro-batch: larger ones amortise per-micro-batch host work")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1, help="ABBA rounds: each runs both sides twice")
    ap.add_argument("--optimizer-states", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--packing", choices=["on", "off"], default="on")
    ap.add_argument("--router-fusion", choices=["on", "off"], default="on",
                    help="the baseline's fused router (mrl cannot use it: it skips routing replay)")
    ap.add_argument("--grouped-gemm", choices=["cublas", "cutlass"], default="cublas",
                    help="TE's grouped GEMM on Hopper, both sides: one cuBLAS GEMM per expert (TE's default) or "
                         "one CUTLASS grouped kernel for all of them (NVTE_USE_CUTLASS_GROUPED_GEMM=1)")
    ap.add_argument("--gc", choices=["auto", "off"], default="auto",
                    help="auto: each side as it ships (megatron's schedule leaves the collector alone, mrl's trainer "
                         "freezes its setup heap: train.gc_freeze); off: both sides frozen and the collector off "
                         "for the timed steps")
    ap.add_argument("--profile", action="store_true",
                    help="torch profiler over two more steps of each side (the first pair): every operator's time")
    ap.add_argument("--phases", action="store_true",
                    help="each side: two more steps with their phases timed between device syncs")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="mrl_vs_megatron_")
    # read by TE's C library in each worker (inherited environment); both sides run with the same value
    os.environ.pop("NVTE_USE_CUTLASS_GROUPED_GEMM", None)
    if a.grouped_gemm == "cutlass":
        os.environ["NVTE_USE_CUTLASS_GROUPED_GEMM"] = "1"
    hf_path = a.hf or make_model(os.path.join(tmp, a.shape), a.shape)
    hf = json.load(open(os.path.join(hf_path, "config.json")))
    dev = device_name()
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in dev), None)
    flops_tok = model_flops_per_token(hf, a.seq)
    common = ["--hf", hf_path, "--seq", str(a.seq), "--micro-batches", str(a.micro_batches),
              "--micro-batch-size", str(a.micro_batch_size), "--reps", str(a.reps),
              "--warmup", str(a.warmup), "--optimizer-states", a.optimizer_states, "--gc", a.gc]
    layouts = {}
    for name in a.layouts:
        nproc, extra = LAYOUTS[name]
        runs = []
        for r in range(a.rounds):
            for side in ("megatron", "mrl", "mrl", "megatron"):
                out = os.path.join(tmp, f"{name}_{r}_{len(runs)}_{side}.json")
                if side == "megatron":
                    nofuse = ["--no-router-fusion"] if a.router_fusion == "off" else []
                    prof = a.profile and r == 0 and not runs
                    args = [*common, *extra, "--out", out, *nofuse, *(["--phases"] if a.phases else []),
                            *(["--profile", os.path.join(tmp, "profile")] if prof else [])]
                    torchrun(nproc, "_megatron_step_worker.py", args)
                else:
                    prof = a.profile and r == 0 and len(runs) == 1
                    args = [*common, *extra, "--packing", a.packing, "--out", out,
                            *(["--profile", os.path.join(tmp, "profile")] if prof else []),
                            *(["--phases"] if a.phases else [])]
                    torchrun(nproc, "_mrl_step_worker.py", args)
                runs.append({"round": r, **json.load(open(out))})
        per_side = {s: [t for x in runs if x["side"] == s for t in x["step_s"]] for s in ("megatron", "mrl")}
        tokens = runs[0]["tokens_per_step"]
        row = {"gpus": nproc, "tokens_per_step": tokens, "runs": runs}
        for s, steps in per_side.items():
            med = statistics.median(steps)
            tps_gpu = tokens / med / nproc
            row[s] = {"step_s": summary(steps), "tokens_per_s_per_gpu": tps_gpu,
                      "model_tflops_per_gpu": tps_gpu * flops_tok / 1e12,
                      "mfu": tps_gpu * flops_tok / 1e12 / peak if peak else None,
                      "peak_memory_gib": max(x["peak_memory_gib"] or 0 for x in runs if x["side"] == s)}
        row["mrl_vs_megatron"] = row["megatron"]["step_s"]["median"] / row["mrl"]["step_s"]["median"]
        # per run pair (ABBA: megatron, mrl, mrl, megatron): each mrl run against its neighbouring megatron run
        pairs = [statistics.median(runs[i]["step_s"]) / statistics.median(runs[j]["step_s"])
                 for k in range(0, len(runs), 4) for i, j in ((k, k + 1), (k + 3, k + 2))]
        row["mrl_vs_megatron_per_pair"] = pairs
        if a.profile:
            for side, stem in (("mrl", "rl_step_profile"), ("megatron", "megatron_step_profile")):
                base = os.path.join(tmp, "profile", f"{stem}_rank0")
                row[f"profile_top_ops_{side}"] = open(base + ".txt").read() if os.path.exists(base + ".txt") else None
                row[f"profile_ops_{side}"] = json.load(open(base + ".json")) if os.path.exists(base + ".json") else None
                row[f"profile_gaps_{side}"] = {}
                for r in range(nproc):  # every rank: one rank's stall is the other's collective wait
                    rbase = os.path.join(tmp, "profile", f"{stem}_rank{r}")
                    if os.path.exists(rbase + "_gaps.json"):
                        row[f"profile_gaps_{side}"][f"rank{r}"] = json.load(open(rbase + "_gaps.json"))
                    if a.json and os.path.exists(rbase + ".trace.json.gz"):  # the timelines beside the report
                        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
                        shutil.copy(rbase + ".trace.json.gz", f"{os.path.splitext(a.json)[0]}_{name}_{side}_rank{r}"
                                                              ".trace.json.gz")
            shutil.rmtree(os.path.join(tmp, "profile"), ignore_errors=True)  # the next layout writes its own
        layouts[name] = row
        m, b = row["mrl"], row["megatron"]
        print(f"{name}: megatron {b['tokens_per_s_per_gpu']:.0f} tok/s/GPU ({b['model_tflops_per_gpu']:.1f} TFLOP/s), "
              f"mrl rl_step {m['tokens_per_s_per_gpu']:.0f} tok/s/GPU ({m['model_tflops_per_gpu']:.1f} TFLOP/s), "
              f"ratio {row['mrl_vs_megatron']:.3f} (pairs {[round(p, 3) for p in pairs]})", flush=True)
    dump({"bench": "rl_step_vs_megatron", "device": dev, "shape": a.shape if not a.hf else hf_path, "hf_config": hf,
          "seq": a.seq, "micro_batches": a.micro_batches,
          "micro_batch_size": a.micro_batch_size, "reps": a.reps, "warmup": a.warmup, "rounds": a.rounds,
          "optimizer_states": a.optimizer_states, "packing": a.packing, "router_fusion": a.router_fusion,
          "grouped_gemm": a.grouped_gemm, "gc": a.gc, "model_flops_per_token": flops_tok, "peak_bf16_tflops": peak,
          "layouts": layouts}, a.json,
         name=f"rl_step_vs_megatron_{a.shape}_{slug(dev)}")


if __name__ == "__main__":
    main()
