"""Shared pieces of the Keep Routing / RL-step benchmarks: checkpoints, torchrun, natural routes.

    python bench/_bench_common.py make-model DIR [--preset gpu|qwen3_30b_a3b_l12|qwen3_30b_a3b|tiny]   # a checkpoint

The ``gpu`` preset: Qwen3-MoE, hidden 1024, 8 layers, 64 experts top-8,
norm_topk_prob, vocab 32768, ~490M parameters, transformers' own random init (std 0.02, norms 1),
saved in bf16 with per-expert names.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))

GPU_PRESET = dict(vocab_size=32768, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=256,
                  num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=64,
                  num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                  tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=4096)
# Qwen3-30B-A3B's shape cut to 12 of its 48 layers (7.9B parameters, bf16 15.8 GB): one GPU trains it
SHAPES = {"gpu": GPU_PRESET, "bench490": GPU_PRESET,
          "qwen3_30b_a3b_l12": dict(GPU_PRESET, vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                    moe_intermediate_size=768, num_hidden_layers=12, num_attention_heads=32,
                                    num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                                    max_position_embeddings=40960),
          # a CPU-sized MoE whose optimizer state is large enough to show host memory in a checkpoint save
          "cpu_ckpt": dict(GPU_PRESET, num_hidden_layers=2)}
# shapes written by bench/_random_checkpoint.py instead (no model instantiated): Qwen3-30B-A3B at its full depth
# (30.5B parameters, 61 GB in bf16), and a CPU-sized one with many experts for the flow's tests
RANDOM_SHAPES = ("qwen3_30b_a3b", "cpu_wide")


def make_model(path: str, preset: str = "gpu", seed: int = 0) -> str:
    """A random Qwen3-MoE HF checkpoint at ``path`` (kept if its config.json already exists)."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    if preset in RANDOM_SHAPES:  # tensor by tensor, sharded: the full 48-layer model needs no model in memory
        from _random_checkpoint import make_checkpoint

        return make_checkpoint(path, preset, None, seed=seed)
    if preset not in SHAPES:
        from mrl.config.schema import TinyPreset
        from mrl.models.tiny import make_tiny_model

        return make_tiny_model(path, TinyPreset(preset), seed=seed)
    from safetensors.torch import save_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from mrl.models.tiny import split_fused_experts

    cfg = Qwen3MoeConfig(architectures=["Qwen3MoeForCausalLM"], bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         **SHAPES[preset])
    torch.manual_seed(seed)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(dev):
        model = Qwen3MoeForCausalLM(cfg)
    model = model.to(torch.bfloat16)
    os.makedirs(path, exist_ok=True)
    cfg.dtype = "bfloat16"
    cfg.save_pretrained(path)
    sd = split_fused_experts({k: v.detach().cpu() for k, v in model.state_dict().items()})
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    del model, sd
    if dev == "cuda":  # the workers that follow need this GPU's memory, not this process's cache
        torch.cuda.empty_cache()
    return path


def spread(xs: list[float]) -> dict:
    """The figures every bench quotes for repeated measurements: median, p25-p75, min and max."""
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return {"median": statistics.median(xs), "p25": q[0], "p75": q[2], "min": min(xs), "max": max(xs)}


def torchrun(nproc: int, script: str, args: list[str], *, timeout: float | None = None) -> None:
    """Run a bench worker under torchrun; raises with the output tail on failure."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.join(HERE, script), *args]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    # workers that share tests/jobs' synthetic batches import them from the repository root
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(HERE), env.get("PYTHONPATH")) if p)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if r.returncode:
        print(r.stdout[-3000:], r.stderr[-6000:], sep="\n")
        raise SystemExit(f"{script} {' '.join(args)} failed ({r.returncode})")


def device_name() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    return "CPU (gloo)"


REPORTS = os.path.join(HERE, "reports")


def slug(device: str) -> str:
    """``2x NVIDIA H200`` -> ``2xH200``, ``1x NVIDIA H100 80GB HBM3`` -> ``1xH100``, ``CPU (gloo)`` ->
    ``cpu<N>core``: the hardware part of a report's name."""
    if device.startswith("CPU"):
        return f"cpu{os.cpu_count()}core"
    n, _, name = device.partition("x ")
    words = name.split()  # "NVIDIA H100 80GB HBM3": the model, not the memory's kind
    return f"{n}x{words[1] if len(words) > 1 and words[0] == 'NVIDIA' else words[-1]}"


def environment() -> dict:
    """Hardware and versions of this run, recorded in every report."""
    import platform
    from datetime import datetime, timezone
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for pkg in ("torch", "megatron-core", "sglang", "transformers", "transformer-engine"):
        try:
            versions[pkg] = version(pkg)
        except PackageNotFoundError:
            versions[pkg] = None
    commit = subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                   cpu)
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    # a copy of the tree without its git history (a device host) names its commit in MRL_COMMIT
    return {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "device": device_name(),
            "cpu": cpu, "cpu_cores": os.cpu_count(), "memory_gib": round(mem_gib, 1), "versions": versions,
            "mrl_commit": os.environ.get("MRL_COMMIT") or commit.stdout.strip() or None,
            "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
            "env": {k: os.environ[k] for k in RECORDED_ENV if k in os.environ}}


RECORDED_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "NVTE_USE_CUTLASS_GROUPED_GEMM", "NCCL_CUMEM_ENABLE", "CUDA_VISIBLE_DEVICES",
                "OMP_NUM_THREADS")
"""Environment variables that change what a benchmark measures, recorded with its hardware and versions."""


TOPICS = (
    ("rl_step_vs_", "rl_step"), ("fwd_bwd_layouts", "rl_step"), ("micro_batches", "rl_step"),
    ("gc_pause", "rl_step"), ("batch_delivery", "rl_step"), ("old_logprob_pass", "rl_step"),
    ("async_vs_sync", "loop"), ("opd_cost", "loop"), ("loop_e2e", "loop"), ("gpu_loop", "loop"),
    ("full_depth", "loop"),
    ("rollout_throughput", "rollouts"), ("routes_decode", "rollouts"),
    ("weight_sync", "weight_sync"), ("lora_sync", "weight_sync"),
    ("replay_overhead", "keep_routing"), ("packing", "keep_routing"), ("routing_mismatch", "keep_routing"),
    ("sampling_mask_payload", "keep_routing"),
    ("mrl_train", "learning"), ("parity", "parity"), ("checkpoint_save", "checkpoints"),
    ("export_time", "checkpoints"), ("image_build", "image"), ("context_parallel", "context_parallel"),
)
"""Report name prefix -> its folder under ``bench/reports/`` (the first prefix that matches; a bench whose
name matches none is refused: add it here, tests/unit/test_bench_reports.py checks every bench's name)."""


def topic(name: str) -> str:
    """The folder of ``bench/reports/`` a report named ``name`` goes to: ``rl_step_vs_megatron_...`` ->
    ``rl_step``."""
    for prefix, t in TOPICS:
        if name.startswith(prefix):
            return t
    raise ValueError(f"report name {name!r} has no topic: add its prefix to TOPICS in bench/_bench_common.py")


def dump(result: dict, path: str | None, *, name: str) -> str:
    """Print ``result`` and write it, with ``environment()``, as a report: ``path``, or by default
    ``bench/reports/<topic>/<date>_<name>.json`` (``topic(name)``). Results carry every repetition, not
    only their summary."""
    folder = os.path.join(REPORTS, topic(name))  # before the run's figures are printed: a bad name fails first
    result = {"environment": environment(), **result}
    print(json.dumps(result))
    if path is None:
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"{result['environment']['date'][:10]}_{name}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"[bench] report: {path}", file=sys.stderr)
    return path


def step_worker_args(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags both sides of bench/rl_step_vs_megatron.py take: model, layout, tokens, repetitions. A step is
    ``--micro-batches`` micro-batches of ``--micro-batch-size`` rows of ``--seq`` tokens per DP rank."""
    ap.add_argument("--hf", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--micro-batch-size", type=int, default=1, help="rows of --seq tokens per micro-batch")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--optimizer-states", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--gc", choices=["auto", "off"], default="auto",
                    help="off: Python's garbage collector frozen and disabled for the timed steps (a collection "
                         "pauses one rank while its peers wait in the next collective)")
    return ap


def gc_mode(mode: str) -> None:
    """Before the timed steps: with ``off``, what setup allocated is frozen out of every later collection
    and automatic collection stops (megatron-LM's ``--manual-gc`` does the same for its training loop)."""
    import gc

    if mode == "off":
        gc.collect()
        gc.freeze()
        gc.disable()


class HostLead:
    """How far the host runs ahead of its GPU within a step, without a profiler: ``mark(name)`` records
    the host's time and a CUDA event at that point of the step; after the step, each mark's ``lead_ms``
    is how long the GPU took to reach it after the host queued it (GPU time of the event since the
    step's start event minus host time since then; the step starts on an idle GPU, after a sync). Near 0:
    the GPU was waiting for the host there; large: the host was that far ahead. Inactive (marks ignored)
    outside ``start()`` / ``stop()`` and without CUDA."""

    def __init__(self):
        self._marks: list[tuple[str, float, object]] = []
        self._on = False

    def start(self) -> None:
        import time

        if not torch.cuda.is_available():
            return
        torch.cuda.synchronize()
        self._e0 = torch.cuda.Event(enable_timing=True)
        self._e0.record()
        self._t0 = time.perf_counter()
        self._marks, self._on = [], True

    def mark(self, name: str) -> None:
        import time

        if not self._on:
            return
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        self._marks.append((name, time.perf_counter() - self._t0, e))

    def stop(self) -> list[dict]:
        if not self._on:
            return []
        self.mark("end")
        torch.cuda.synchronize()
        self._on = False
        out = []
        for name, host_s, e in self._marks:
            gpu_ms = self._e0.elapsed_time(e)
            out.append({"at": name, "host_ms": round(host_s * 1e3, 3), "gpu_ms": round(gpu_ms, 3),
                        "lead_ms": round(gpu_ms - host_s * 1e3, 3)})
        return out


class GcTimes:
    """Seconds Python's collector ran, per generation, from ``start()`` on (``gc.callbacks``): how much of
    a step's time, and of its spread, is garbage collection."""

    def __init__(self):
        self.seconds = [0.0, 0.0, 0.0]
        self.count = [0, 0, 0]
        self._t0 = None

    def start(self) -> "GcTimes":
        import gc

        gc.callbacks.append(self._cb)
        return self

    def _cb(self, phase: str, info: dict) -> None:
        import time

        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            g = info["generation"]
            self.seconds[g] += time.perf_counter() - self._t0
            self.count[g] += 1
            self._t0 = None

    def snapshot(self) -> dict:
        return {"seconds_by_generation": list(self.seconds), "collections_by_generation": list(self.count)}


def allocator_counts() -> dict:
    """The CUDA caching allocator's running counts (device allocations and frees, retries after a failed
    allocation): their growth over the timed steps says whether the allocator kept going back to the
    driver, which synchronizes. Empty without CUDA."""
    if not torch.cuda.is_available():
        return {}
    s = torch.cuda.memory_stats()
    keys = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")
    return {k: s.get(k, 0) for k in keys}


# -- inside workers (megatron imported) ------------------------------------------------------------

def record_routes(model, layout, rank_slice, cfg, mbs, *, vocab_size: int, num_layers: int, top_k: int,
                  num_experts: int) -> list[torch.Tensor]:
    """The model's own natural routing of each micro-batch as engine-style routes ``[b, S, L, K]``
    (int64, every MoE column of this PP stage filled; other columns get valid dummy ids).

    One forward-only RECORD pass; with sequence parallelism each TP rank routed its S/tp chunk, so the
    chunks are all-gathered over TP."""
    import torch.distributed as dist

    from mrl.megatron.train_step import forward_backward
    from mrl.routing.replay import ReplayDriver, ReplayMode

    rec = ReplayDriver(cfg, rank_slice, ReplayMode.record)
    forward_backward(model, layout, mbs, vocab_size=vocab_size, forward_only=True, driver=rec)
    out = []
    for mb, layers in zip(mbs, rec.recorded):
        b, s = mb.input_ids.shape
        dev = mb.input_ids.device
        routes = (torch.arange(top_k, device=dev) % num_experts).expand(b, s, num_layers, top_k).clone()
        for j, col in enumerate(rank_slice.moe_columns):
            t = layers[j].to(dev)
            t = t.view(-1, b, top_k).transpose(0, 1).contiguous()  # [b, S_local, K]
            if rank_slice.sequence_parallel and rank_slice.tp_size > 1:
                parts = [torch.empty_like(t) for _ in range(rank_slice.tp_size)]
                dist.all_gather(parts, t, group=layout.tp.group)
                t = torch.cat(parts, 1)
            routes[:, :, col] = t.long()
        out.append(routes)
    return out


def run_layouts(worker: str, layouts: list[str], layout_args: dict, tmp: str, args: list[str]) -> dict:
    """Run ``worker`` once per layout name (``layout_args[name] = (nproc, extra args)``); each writes its
    result JSON to ``--out``. Returns {layout: result}."""
    rows = {}
    for name in layouts:
        n, extra = layout_args[name]
        out = os.path.join(tmp, f"{name}.json")
        torchrun(n, worker, [*args, "--out", out, *extra])
        with open(out) as f:
            rows[name] = json.load(f)
    return rows


def profile_steps(run_steps, steps: int, out_dir: str, name: str, rank: int) -> dict:
    """``run_steps()`` (``steps`` training steps) under the torch profiler (with Python stacks): writes
    ``<name>_rank<r>.txt`` (top operators by device time), ``<name>_rank<r>.json`` (the 150 largest
    operators: device and host microseconds, calls), ``<name>_rank<r>_gaps.json`` (where the GPU sat idle
    and what the host did meanwhile: ``trace_gaps``) and the compressed timeline
    ``<name>_rank<r>.trace.json.gz`` (chrome://tracing, Perfetto) to ``out_dir``, so that two sides' steps
    can be compared operator by operator and stall by stall; returns the host syncs per step."""
    import gzip
    import shutil

    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
                 with_stack=True) as prof:
        run_steps()
    if cuda:
        torch.cuda.synchronize()
    ka = prof.key_averages()
    dev_attr = "self_device_time_total" if hasattr(ka[0], "self_device_time_total") else "self_cuda_time_total"
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"{name}_rank{rank}")
    with open(stem + ".txt", "w") as f:
        f.write(ka.table(sort_by=dev_attr if cuda else "self_cpu_time_total", row_limit=40))
    ops = sorted(({"op": e.key, "device_us": getattr(e, dev_attr, 0.0) if cuda else 0.0,
                   "host_us": e.self_cpu_time_total, "calls": e.count} for e in ka),
                 key=lambda r: -(r["device_us"] or r["host_us"]))
    with open(stem + ".json", "w") as f:
        json.dump(ops[:150], f, indent=0)
    prof.export_chrome_trace(stem + ".trace.json")
    with open(stem + "_gaps.json", "w") as f:
        json.dump(trace_gaps(stem + ".trace.json", steps), f, indent=1)
    with open(stem + ".trace.json", "rb") as src, gzip.open(stem + ".trace.json.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(stem + ".trace.json")
    return {"host_syncs_per_step": {e.key: e.count // steps for e in ka if e.key in (
        "aten::item", "aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize",
        "cudaEventSynchronize", "aten::nonzero", "cudaMemcpyAsync")}}


_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_BLOCKING = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync",
             "cudaMemcpy")


def _own_frames(frames: list[str], n: int = 6) -> list[str]:
    """The innermost ``n`` Python frames of mrl, megatron or the bench (library internals left out)."""
    keep = [f for f in frames if any(k in f for k in ("mrl/", "megatron/", "bench/", "_worker.py"))]
    return keep[-n:]


def trace_gaps(trace_path: str, steps: int, min_gap_us: float = 50.0, top: int = 30) -> dict:
    """Where a profiled run's GPU sat idle, from its chrome trace: idle time per step (no kernel, copy or
    memset on any stream), and the ``top`` longest gaps, each with the device work that ended it, the
    Python stack that launched that work, and the longest blocking CUDA call (a synchronize or a
    blocking copy) the launching thread made during the gap, with its own stack: the host sync that
    held the launch back. Call sites are summed over all gaps too (``by_site``)."""
    with open(trace_path) as f:
        events = [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X"]
    device = sorted((e for e in events if e.get("cat") in _DEVICE_CATS), key=lambda e: e["ts"])
    if not device:
        return {"idle_us_per_step": None, "gaps": [], "by_site": []}
    runtime = {e["args"]["correlation"]: e for e in events
               if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    blocking = sorted((e for e in events if e.get("cat") == "cuda_runtime" and e["name"] in _BLOCKING),
                      key=lambda e: e["ts"])
    host = [e for e in events if e.get("cat") in ("python_function", "cpu_op")]

    def stack(tid, ts):  # enclosing Python frames, outermost first; on a thread without Python (autograd's
        # backward) the innermost operators instead
        enc = sorted((e for e in host if e["tid"] == tid and e["ts"] <= ts <= e["ts"] + e["dur"]),
                     key=lambda e: e["ts"])
        frames = _own_frames([e["name"] for e in enc if e["cat"] == "python_function"])
        return frames or [e["name"][:100] for e in enc if e["cat"] == "cpu_op"][-3:]

    gaps, end, idle = [], device[0]["ts"] + device[0]["dur"], 0.0
    for e in device[1:]:
        if e["ts"] - end >= min_gap_us:
            gaps.append((e["ts"] - end, end, e))
            idle += e["ts"] - end
        end = max(end, e["ts"] + e["dur"])
    span = end - device[0]["ts"]
    rows, sites = [], {}
    for gap, start, nxt in sorted(gaps, key=lambda g: -g[0])[:top]:
        launch = runtime.get(nxt.get("args", {}).get("correlation"))
        row = {"gap_us": round(gap, 1), "at_us": round(start - device[0]["ts"], 1), "next": nxt["name"][:120]}
        if launch is not None:
            row["launch"] = launch["name"]
            row["launch_stack"] = stack(launch["tid"], launch["ts"])
            held = [b for b in blocking if b["tid"] == launch["tid"] and b["ts"] < launch["ts"]
                    and b["ts"] + b["dur"] > start]
            if held:
                b = max(held, key=lambda b: b["dur"])
                row["blocked_by"] = {"call": b["name"], "us": round(b["dur"], 1), "stack": stack(b["tid"], b["ts"])}
        rows.append(row)
        site = " <- ".join(reversed((row.get("blocked_by") or {}).get("stack") or row.get("launch_stack") or ["?"]))
        s = sites.setdefault(site, {"site": site, "gaps": 0, "gap_us": 0.0})
        s["gaps"] += 1
        s["gap_us"] = round(s["gap_us"] + gap, 1)
    return {"span_us_per_step": round(span / steps, 1), "idle_us_per_step": round(idle / steps, 1),
            "idle_fraction": round(idle / span, 4) if span else None, "gaps_over_min": len(gaps),
            "min_gap_us": min_gap_us, "gaps": rows,
            "by_site": sorted(sites.values(), key=lambda s: -s["gap_us"])}


def timed(fn) -> float:
    """Wall time of ``fn()`` on the slowest rank (barrier before, CUDA synchronised around)."""
    import time

    import torch.distributed as dist

    from mrl.megatron import compat

    dist.barrier()
    if compat.HAS_CUDA:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if compat.HAS_CUDA:
        torch.cuda.synchronize()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=compat.DEVICE)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # done when the slowest rank is done
    return t.item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["make-model"])
    ap.add_argument("path")
    ap.add_argument("--preset", default="gpu")
    a = ap.parse_args()
    print(make_model(a.path, a.preset))


if __name__ == "__main__":
    main()


def engine_call(url: str, fn):
    """``fn(client)`` against one engine from synchronous bench code, the client closed after it."""
    import asyncio

    from mrl.sglang.client import EngineClient

    async def go():
        c = EngineClient(url)
        try:
            return await fn(c)
        finally:
            await c.close()

    return asyncio.run(go())
