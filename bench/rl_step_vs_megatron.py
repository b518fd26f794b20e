"""mrl's RL step against plain megatron-core's training step: same model shape, spec, layout, GPU and tokens.

    python bench/rl_step_vs_megatron.py --shape bench490 --layouts tp1             # one GPU
    python bench/rl_step_vs_megatron.py --shape qwen3_30b_a3b_l12 --optimizer-states bf16 --profile
    python bench/rl_step_vs_megatron.py --shape tiny --seq 64      # without CUDA: a debug run (gloo, fp32)

Baseline (``_megatron_step_worker.py``): megatron's own model, labels, schedule and optimizer step, no mrl
code. Measured (``_mrl_step_worker.py``): ``Policy.rl_step`` with replay and packing on. Both step the
optimizer once per ``--micro-batches`` rows of ``--seq`` tokens per DP rank. The two sides cannot share
one process (a 30B-class slice fits one GPU once), so they alternate by process in ABBA order
(megatron, mrl, mrl, megatron) over ``--rounds``.

The headline figure, fixed before any run: per layout, the median over ABBA pairs of megatron's step
time / mrl's step time, a pair being timed step i of an mrl process and timed step i of its neighbouring
megatron process (the first mrl process of a round with the round's first megatron process, the second
with the last), warm-up steps left out; ``--rounds`` x 2 x ``--reps`` pairs, at least 8 (fewer is refused
before anything runs). Neighbouring processes ran minutes apart on the same host, so a pair shares the
host's state; the median of many pairs is not moved by one slow step the way a ratio of two pooled medians
is. The pooled figure (median of all megatron steps / median of all mrl steps) is kept as a secondary key,
as is every step of every process, and the host's load average and other GPU processes before and after
each layout (a busy host makes a pair meaningless). Model TFLOP/s counts the matmuls of
attention (projections and the causal core), the routed and shared experts, router and LM head, forward
and backward (x3); MFU against the GPU's dense bf16 peak.
"""

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time

from _bench_common import device_name, dump, make_model, slug, spread, torchrun

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


ABBA = ("megatron", "mrl", "mrl", "megatron")
MIN_PAIRS = 8


def expected_pairs(reps: int, rounds: int) -> int:
    """Pairs a layout yields: two mrl processes a round, each paired step by step with its neighbour."""
    return 2 * rounds * reps


def check_pair_count(reps: int, rounds: int, min_pairs: int = MIN_PAIRS) -> None:
    """Refuse, before anything runs, a repetition plan whose statistic would rest on too few pairs."""
    n = expected_pairs(reps, rounds)
    if n < min_pairs:
        raise SystemExit(f"--reps {reps} --rounds {rounds} give {n} ABBA pairs per layout (2 x rounds x reps); "
                         f"the statistic needs at least {min_pairs}: raise --reps or --rounds")


def abba_pairs(runs: list[dict], min_pairs: int = MIN_PAIRS) -> dict:
    """The fixed statistic over one layout's processes (``runs`` in the order they ran, ABBA per round,
    each with ``side`` and its timed ``step_s``): timed step i of each mrl process against timed step i
    of its neighbouring megatron process, ratio megatron / mrl (above 1: mrl faster).

    Returns every ratio (``pairs``) with where it came from (``index``: [megatron run, mrl run, step]),
    their ``median``, ``p25``, ``p75`` and ``n_pairs``. Raises ValueError when the runs are not in ABBA
    order, a pair's processes timed different numbers of steps, or fewer than ``min_pairs`` pairs result."""
    if len(runs) % 4 or any(r["side"] != ABBA[i % 4] for i, r in enumerate(runs)):
        raise ValueError(f"runs are not in ABBA order ({', '.join(ABBA)} per round): "
                         f"{[r['side'] for r in runs]}")
    ratios, index = [], []
    for k in range(0, len(runs), 4):
        for meg, mrl in ((k, k + 1), (k + 3, k + 2)):
            a, b = runs[meg]["step_s"], runs[mrl]["step_s"]
            if len(a) != len(b):
                raise ValueError(f"megatron run {meg} timed {len(a)} steps, its mrl neighbour {mrl} {len(b)}")
            for i, (t_meg, t_mrl) in enumerate(zip(a, b)):
                ratios.append(t_meg / t_mrl)
                index.append([meg, mrl, i])
    if len(ratios) < min_pairs:
        raise ValueError(f"{len(ratios)} ABBA pairs, the statistic needs at least {min_pairs}")
    q = statistics.quantiles(ratios, n=4)
    return {"median": statistics.median(ratios), "p25": q[0], "p75": q[2], "n_pairs": len(ratios),
            "pairs": ratios, "index": index}


def pair_line(stat: dict) -> str:
    """The figure as it is quoted: ``ratio <median> (p25-p75 a-b, n pairs)``."""
    return f"ratio {stat['median']:.3f} (p25-p75 {stat['p25']:.3f}-{stat['p75']:.3f}, {stat['n_pairs']} pairs)"


def host_state(cuda: bool) -> dict:
    """How quiet the host is: load averages and, with CUDA, every process holding a GPU context
    (``nvidia-smi --query-compute-apps``; this process's own context is marked ``self``)."""
    out = {"loadavg": list(os.getloadavg()), "gpu_processes": None}
    if cuda and shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory,gpu_uuid",
                            "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=60)
        if r.returncode == 0:
            procs = []
            for line in r.stdout.splitlines():
                f = [x.strip() for x in line.split(",")]
                if len(f) == 4:
                    procs.append({"pid": int(f[0]) if f[0].isdigit() else f[0], "name": f[1],
                                  "used_mib": int(f[2]) if f[2].isdigit() else f[2], "gpu": f[3],
                                  "self": f[0] == str(os.getpid())})
            out["gpu_processes"] = procs
        else:
            out["gpu_processes_error"] = (r.stderr or r.stdout).strip()[-500:]
    return out


def shape_checkpoint(root: str, shape: str) -> str:
    """The random checkpoint of ``shape`` under ``root``, written unless a complete one is there (a run
    killed while writing leaves no marker, and its directory is written again)."""
    path, done = os.path.join(root, shape), os.path.join(root, f"{shape}.complete")
    if not os.path.exists(done):
        shutil.rmtree(path, ignore_errors=True)
        make_model(path, shape)
        open(done, "w").close()
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="bench490", help="bench490 | qwen3_30b_a3b_l12 | tiny (a _bench_common preset)")
    ap.add_argument("--hf", default=None, help="an existing Qwen3-MoE checkpoint instead of --shape")
    ap.add_argument("--model-dir", default=None,
                    help="keep the --shape checkpoint in DIR/<shape> and reuse it in later runs (default: a "
                         "temporary directory, removed at the end; the 30B slice is 15.8 GB)")
    ap.add_argument("--layouts", nargs="+", default=["tp1"])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--micro-batch-size", type=int, default=1,
                    help="rows of --seq tokens per micro-batch: larger ones amortise per-micro-batch host work")
    ap.add_argument("--reps", type=int, default=6, help="timed steps per process (after --warmup)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1,
                    help=f"ABBA rounds: each runs both sides twice; 2 x rounds x reps >= {MIN_PAIRS} pairs")
    ap.add_argument("--optimizer-states", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--packing", choices=["on", "off"], default="on")
    ap.add_argument("--router-fusion", choices=["on", "off"], default="on",
                    help="the baseline's fused router (megatron's fused path skips routing replay)")
    ap.add_argument("--fused-router-replay", choices=["on", "off"], default="off",
                    help="mrl side: routing replay through TE's fused router kernels (train.fused_router_replay; "
                         "GPU with Transformer Engine only)")
    ap.add_argument("--fused-logprob", choices=["on", "off"], default="on",
                    help="mrl side: token logprobs with TE's fused cross-entropy kernel (train.fused_logprob)")
    ap.add_argument("--ce-fusion", choices=["off", "native", "te"], default="native",
                    help="the baseline's cross-entropy fusion (megatron's cross_entropy_loss_fusion and its impl)")
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
    ap.add_argument("--host-lead", action="store_true",
                    help="each side: two more steps with HostLead marks (how far the host ran ahead of the GPU at "
                         "each micro-batch's forward, after backward, at the optimizer step; CUDA only)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    check_pair_count(a.reps, a.rounds)
    tmp = tempfile.mkdtemp(prefix="mrl_vs_megatron_")
    atexit.register(shutil.rmtree, tmp, True)  # a failed run too: it may hold the shape's checkpoint
    # read by TE's C library in each worker (inherited environment); both sides run with the same value
    os.environ.pop("NVTE_USE_CUTLASS_GROUPED_GEMM", None)
    if a.grouped_gemm == "cutlass":
        os.environ["NVTE_USE_CUTLASS_GROUPED_GEMM"] = "1"
    t0 = time.perf_counter()
    hf_path = a.hf or shape_checkpoint(a.model_dir or tmp, a.shape)
    checkpoint_s = time.perf_counter() - t0
    hf = json.load(open(os.path.join(hf_path, "config.json")))
    dev = device_name()
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in dev), None)
    flops_tok = model_flops_per_token(hf, a.seq)
    common = ["--hf", hf_path, "--seq", str(a.seq), "--micro-batches", str(a.micro_batches),
              "--micro-batch-size", str(a.micro_batch_size), "--reps", str(a.reps),
              "--warmup", str(a.warmup), "--optimizer-states", a.optimizer_states, "--gc", a.gc,
              *(["--host-lead"] if a.host_lead else [])]
    cuda = dev != "CPU (gloo)"
    layouts = {}
    for name in a.layouts:
        nproc, extra = LAYOUTS[name]
        runs = []
        host_before = host_state(cuda)
        for r in range(a.rounds):
            for side in ABBA:
                t0 = time.perf_counter()
                out = os.path.join(tmp, f"{name}_{r}_{len(runs)}_{side}.json")
                if side == "megatron":
                    nofuse = ["--no-router-fusion"] if a.router_fusion == "off" else []
                    prof = a.profile and r == 0 and not runs
                    args = [*common, *extra, "--out", out, *nofuse, "--ce-fusion", a.ce_fusion,
                            *(["--phases"] if a.phases else []),
                            *(["--profile", os.path.join(tmp, "profile")] if prof else [])]
                    torchrun(nproc, "_megatron_step_worker.py", args)
                else:
                    prof = a.profile and r == 0 and len(runs) == 1
                    args = [*common, *extra, "--packing", a.packing, "--out", out,
                            "--fused-router-replay", a.fused_router_replay, "--fused-logprob", a.fused_logprob,
                            *(["--profile", os.path.join(tmp, "profile")] if prof else []),
                            *(["--phases"] if a.phases else [])]
                    torchrun(nproc, "_mrl_step_worker.py", args)
                # the whole process (start, setup, warm-up, timed steps, teardown): plans the next session
                runs.append({"round": r, **json.load(open(out)), "process_wall_s": time.perf_counter() - t0})
        host_after = host_state(cuda)
        others = [p for h in (host_before, host_after) for p in h["gpu_processes"] or [] if not p["self"]]
        if others:  # the figure stands, but the report must say the host was not quiet
            print(f"[bench] {name}: other processes held the GPUs before or after the layout: {others}", flush=True)
        per_side = {s: [t for x in runs if x["side"] == s for t in x["step_s"]] for s in ("megatron", "mrl")}
        tokens = runs[0]["tokens_per_step"]
        row = {"gpus": nproc, "tokens_per_step": tokens, "runs": runs,
               "host": {"before": host_before, "after": host_after}}
        for s, steps in per_side.items():
            med = statistics.median(steps)
            tps_gpu = tokens / med / nproc
            row[s] = {"step_s": spread(steps), "tokens_per_s_per_gpu": tps_gpu,
                      "model_tflops_per_gpu": tps_gpu * flops_tok / 1e12,
                      "mfu": tps_gpu * flops_tok / 1e12 / peak if peak else None,
                      "peak_memory_gib": max(x["peak_memory_gib"] or 0 for x in runs if x["side"] == s)}
        stat = abba_pairs(runs)
        row["mrl_vs_megatron"] = stat["median"]  # the headline: median of per-pair ratios
        row["mrl_vs_megatron_pairs"] = stat
        row["mrl_vs_megatron_pooled_medians"] = row["megatron"]["step_s"]["median"] / row["mrl"]["step_s"]["median"]
        # each mrl process's median step against its neighbouring megatron process's (ABBA)
        per_process = [statistics.median(runs[i]["step_s"]) / statistics.median(runs[j]["step_s"])
                       for k in range(0, len(runs), 4) for i, j in ((k, k + 1), (k + 3, k + 2))]
        row["mrl_vs_megatron_per_process_pair"] = per_process
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
              f"{pair_line(stat)}; pooled medians {row['mrl_vs_megatron_pooled_medians']:.3f}, per process pair "
              f"{[round(p, 3) for p in per_process]}; load average {host_before['loadavg'][0]:.2f} -> "
              f"{host_after['loadavg'][0]:.2f}", flush=True)
    dump({"bench": "rl_step_vs_megatron", "device": dev, "shape": a.shape if not a.hf else hf_path, "hf_config": hf,
          "seq": a.seq, "micro_batches": a.micro_batches,
          "micro_batch_size": a.micro_batch_size, "reps": a.reps, "warmup": a.warmup, "rounds": a.rounds,
          "optimizer_states": a.optimizer_states, "packing": a.packing, "router_fusion": a.router_fusion,
          "fused_router_replay": a.fused_router_replay, "fused_logprob": a.fused_logprob, "ce_fusion": a.ce_fusion,
          "host_lead": a.host_lead,
          "statistic": "median of per-pair ratios (ABBA)",
          "grouped_gemm": a.grouped_gemm, "gc": a.gc, "checkpoint_s": checkpoint_s,
          "model_flops_per_token": flops_tok, "peak_bf16_tflops": peak,
          "layouts": layouts}, a.json,
         name=f"rl_step_vs_megatron_{a.shape}_{slug(dev)}")


if __name__ == "__main__":
    main()
