"""The RL loop's GPU pieces against a live SGLang engine: rollout throughput with and without routes, Keep
Routing (engine vs trainer, replay off and on) and weight sync into the engine vs a raw NCCL broadcast.

    python bench/gpu_loop.py --engine-gpu 1 --trainer-gpus 0 --out DIR          # 2 GPUs, probe model
    python bench/gpu_loop.py --model qwen3_30b_a3b --layers 4 --sections replay --out DIR
    python bench/gpu_loop.py --cpu --out DIR                                       # the same flow on CPU, tiny model

One engine (mrl's launcher, GPU mode: bf16, triton or FA3 attention, CUDA graphs) serves a random-init
Qwen3-MoE checkpoint on ``--engine-gpu``; the trainer side runs on ``--trainer-gpus`` (megatron-core,
bf16, NCCL). Sections:

- ``rollout``: GRPO-shaped workloads (groups of 8, one request per sample, random ``--prompt-len``
  prompts, ``--new`` tokens each, temperature 1, ignore_eos) through mrl's RolloutManager at each
  ``--batches`` concurrency, with routes returned and decoded (Keep Routing on) and without; the
  kinds alternate within each repetition. Also the routes payload of one response as the engine sends
  it (base64 bytes per token, bytes per expert id: 1 with mrl's compact routes, 4 with SGLang's int32
  under ``--routes-int32``, the baseline to compare with on the same machine).
- ``replay``: ``--replay-samples`` engine samples with their routes and logprobs, then the trainer's
  forward on the same tokens (``tests/jobs/replay_check.py``) with the routers free (replay off) and
  replaying the engine's experts (on): route agreement per (token, MoE layer) and mean |logprob diff|
  over the response tokens.
- ``sync``: ``bench/_live_sync_worker.py``: mrl's weight sync into this engine, each repetition
  followed by a raw broadcast of the same bytes between the same devices.

Everything lands in DIR/gpu_loop.json with every repetition, the hardware and the versions.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

# Qwen3-MoE shapes; "probe" is the 2.4 GB bf16 model the SGLang GPU measurements used (hidden 1024,
# 8 layers, 64 experts top-8, vocab 32768), "qwen3_30b_a3b" the real model's layer shape (cut with --layers).
SHAPES = {
    "probe": dict(vocab_size=32768, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=704,
                  num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=128, num_experts=64,
                  num_experts_per_tok=8),
    "qwen3_30b_a3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8),
}


def make_checkpoint(path: str, shape: str, layers: int | None, seed: int = 0) -> str:
    """A random Qwen3-MoE checkpoint in bf16 with per-expert names, made on the GPU (kept if present)."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from mrl.models.tiny import split_fused_experts

    kw = dict(SHAPES[shape])
    if layers:
        kw["num_hidden_layers"] = layers
    cfg = Qwen3MoeConfig(architectures=["Qwen3MoeForCausalLM"], bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, tie_word_embeddings=False,
                         rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=4096, **kw)
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    os.makedirs(path, exist_ok=True)
    cfg.dtype = "bfloat16"
    cfg.save_pretrained(path)
    sd = split_fused_experts({k: v.detach().cpu() for k, v in model.state_dict().items()})
    del model
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    return path


def environment(cpu: bool) -> dict:
    import megatron.core
    import sglang
    import torch
    import transformers

    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "sglang": sglang.__version__, "transformers": transformers.__version__,
           "megatron_core": megatron.core.__version__, "cpu_count": os.cpu_count()}
    try:
        import transformer_engine

        env["transformer_engine"] = transformer_engine.__version__
    except ImportError:
        env["transformer_engine"] = None
    if not cpu:
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    from _bench_common import RECORDED_ENV

    commit = subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    env["mrl_commit"] = os.environ.get("MRL_COMMIT") or commit.stdout.strip() or None
    env["env"] = {k: os.environ[k] for k in RECORDED_ENV if k in os.environ}
    return env


def _pythonpath() -> str:
    """The repo first (workers run as ``-m tests.jobs...``), then whatever the caller's path holds."""
    return ROOT + (":" + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")


# -- rollout ---------------------------------------------------------------------------------------
async def _workload(url: str, codec, batch: int, prompt_len: int, new: int, vocab: int, seed: int):
    from mrl.rollout.client import EngineClient
    from mrl.rollout.manager import RolloutManager
    from mrl.rollout.sample import SamplingSpec

    rng = random.Random(seed)
    client = EngineClient(url)
    codec = _TimedCodec(codec) if codec is not None else None
    mgr = RolloutManager([client], codec=codec, max_inflight_per_engine=batch,
                         sampling=SamplingSpec(max_new_tokens=new, temperature=1.0, ignore_eos=True))
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(batch // 8)]
    t = time.perf_counter()
    groups = await asyncio.gather(*(mgr.generate_group(p, n=8, group_id=i) for i, p in enumerate(prompts)))
    dt = time.perf_counter() - t
    await client.close()
    samples = [s for g in groups for s in g]
    if mgr.stats.failed:
        raise RuntimeError(f"{mgr.stats.failed} samples failed: {mgr.stats.errors[:3]}")
    return samples, sum(len(s.response_ids) for s in samples) / dt, dt, codec.seconds if codec else 0.0


class _TimedCodec:
    """The routes codec, with the client's seconds spent decoding routes counted (they sit in the
    workload's wall time: the client's event loop decodes each reply as it arrives)."""

    def __init__(self, codec):
        self._codec, self.seconds = codec, 0.0

    def __getattr__(self, name):
        return getattr(self._codec, name)

    def decode(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self._codec.decode(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t


async def _routes_payload(url: str, codec, prompt_len: int, new: int, vocab: int) -> dict:
    """Bytes of one reply's routes as the engine sends them (base64), per token, and per expert id."""
    import base64

    from mrl.rollout.client import EngineClient

    c = EngineClient(url)
    ids = [3 + i % (vocab - 3) for i in range(prompt_len)]
    out = await c.generate(ids, {"max_new_tokens": new, "ignore_eos": True}, rid=f"payload-{time.time_ns()}",
                           return_routed_experts=True)
    await c.close()
    rows = prompt_len + len(out.output_ids) - 1
    raw = len(base64.b64decode(out.routed_experts))
    return {"routes_b64_bytes": len(out.routed_experts), "rows": rows,
            "bytes_per_token": len(out.routed_experts) / rows, "raw_bytes_per_token": raw / rows,
            "bytes_per_expert_id": codec.wire_itemsize(raw, rows)}


def _py_spy(a, engine_pid: int, out: str) -> subprocess.Popen | None:
    """Sample the engine's processes (server, scheduler, detokenizer) while one workload runs."""
    if not a.py_spy:
        return None
    return subprocess.Popen([a.py_spy_bin, "record", "--pid", str(engine_pid), "--subprocesses", "--nonblocking",
                             "--rate", "200", "--duration", str(a.py_spy), "--format", "raw", "--output", out],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def spy_summary(raw_path: str, top: int = 25) -> dict:
    """py-spy's collapsed stacks (``process;frame;...;leaf count``) -> per process: samples, the leaf
    frames with most samples (self time) and the frames with most samples anywhere on the stack."""
    procs: dict[str, dict] = {}
    for line in open(raw_path):
        stack, _, n = line.rstrip("\n").rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        k = 0  # a child process's stack sits under its parents' "process PID:cmdline" frames
        while k + 1 < len(frames) and frames[k + 1].startswith("process "):
            k += 1
        name, frames = frames[k][:90], frames[k + 1:] or ["(no frame)"]
        p = procs.setdefault(name, {"samples": 0, "self": {}, "total": {}})
        p["samples"] += int(n)
        p["self"][frames[-1]] = p["self"].get(frames[-1], 0) + int(n)
        for f in set(frames):
            p["total"][f] = p["total"].get(f, 0) + int(n)
    return {name: {"samples": p["samples"],
                   "self_top": sorted(p["self"].items(), key=lambda kv: -kv[1])[:top],
                   "total_top": sorted(p["total"].items(), key=lambda kv: -kv[1])[:top]}
            for name, p in sorted(procs.items(), key=lambda kv: -kv[1]["samples"])}


def rollout_section(url, codec, vocab, a, engine_pid: int | None = None) -> dict:
    res = {"batches": a.batches, "prompt_len": a.prompt_len, "new": a.new, "reps": a.reps, "runs": []}
    asyncio.run(_workload(url, codec, 8, a.prompt_len, 16, vocab, seed=0))  # warm-up (first requests, graphs)
    for rep in range(a.reps):
        for batch in a.batches:
            for routes in (False, True):
                spy_out = os.path.join(a.out, f"py_spy_batch{batch}_routes_{'on' if routes else 'off'}.txt")
                spy = _py_spy(a, engine_pid, spy_out) if rep == 0 and batch == max(a.batches) else None
                _, tps, dt, dec = asyncio.run(_workload(url, codec if routes else None, batch, a.prompt_len, a.new,
                                                        vocab, seed=rep))
                res["runs"].append({"rep": rep, "batch": batch, "routes": routes, "tokens_per_s": tps, "seconds": dt,
                                    "client_decode_s": dec})
                print(f"[rollout] rep {rep} batch {batch} routes {routes}: {tps:.0f} tokens/s", flush=True)
                if spy is not None:
                    _, err = spy.communicate(timeout=a.py_spy + 60)
                    key = f"py_spy_batch{batch}_routes_{'on' if routes else 'off'}"
                    res[key] = (spy_summary(spy_out) if spy.returncode == 0 and os.path.exists(spy_out)
                                else {"error": f"py-spy exited {spy.returncode}: {err[-1500:]}"})
    summary = {}
    for batch in a.batches:
        off = [r["tokens_per_s"] for r in res["runs"] if r["batch"] == batch and not r["routes"]]
        on = [r["tokens_per_s"] for r in res["runs"] if r["batch"] == batch and r["routes"]]
        per_rep = [x / y for x, y in zip(on, off)]
        summary[f"batch{batch}"] = {"routes_off_median": statistics.median(off),
                                    "routes_on_median": statistics.median(on),
                                    "on_vs_off_median": statistics.median(per_rep), "on_vs_off_min": min(per_rep),
                                    "on_vs_off_max": max(per_rep)}
    res["payload"] = asyncio.run(_routes_payload(url, codec, a.prompt_len, a.new, vocab))
    for s in summary.values():  # the same engine, so the same payload at every batch size
        s["routes_b64_bytes_per_token"] = res["payload"]["bytes_per_token"]
        s["routes_bytes_per_expert_id"] = res["payload"]["bytes_per_expert_id"]
    res["summary"] = summary
    print(f"[rollout] routes payload: {res['payload']['bytes_per_token']:.0f} base64 bytes per token, "
          f"{res['payload']['bytes_per_expert_id']} byte(s) per expert id", flush=True)
    return res


# -- Keep Routing ----------------------------------------------------------------------------------
def _agreement(samples_json: dict, rep: dict, calls: list) -> tuple[int, int]:
    """(agreeing, total) (token, MoE layer) decisions: routers' expert sets vs the engine's. TP1, no SP, not
    packed: token i of a router call is (s, b) = (i // rows, i % rows) of its micro-batch."""
    ncol, rows = len(rep["moe_columns"]), rep["per_mb"]
    agree = total = 0
    for n, (col, ids) in enumerate(calls):
        mb = n // ncol
        for i, got in enumerate(ids):
            s, b = divmod(i, rows)
            seq = rep["sequences"][mb * rows + b]
            routes = samples_json["routes"][seq]
            if s < len(samples_json["sequences"][seq]) - 1:
                total += 1
                agree += sorted(got) == sorted(routes[s][rep["moe_columns"][col]])
    return agree, total


def replay_section(url, codec, vocab, a, hf: str, out: str) -> dict:
    import numpy as np

    samples, _, _, _ = asyncio.run(_workload(url, codec, a.replay_samples, a.replay_prompt_len, a.replay_new, vocab,
                                          seed=123))
    sj = {"sequences": [s.tokens for s in samples], "routes": [s.routes.tolist() for s in samples],
          "engine_logprobs": [s.response_logprobs for s in samples],
          "prompt_lens": [len(s.prompt_ids) for s in samples]}
    path = os.path.join(out, "replay_samples.json")
    with open(path, "w") as f:
        json.dump(sj, f)
    rdir = os.path.join(out, "replay")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=a.trainer_gpus.split(",")[0], PYTHONPATH=_pythonpath())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "-m",
           "tests.jobs.replay_check", "--hf", hf, "--input", path, "--out", rdir, "--dtype", a.dtype,
           "--micro-batches", str(a.replay_micro_batches)]
    t = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, timeout=900)
    with open(os.path.join(rdir, "rank0.json")) as f:
        rep = json.load(f)
    on_a, on_t = _agreement(sj, rep, rep["forward_calls"])
    off_a, off_t = _agreement(sj, rep, rep["natural_calls"])
    diffs = {}
    for key, name in (("logprobs_natural", "off"), ("logprobs_replay", "on")):
        vals = []
        for mb, lps in enumerate(rep[key]):
            for b, lp in enumerate(lps):
                i = rep["sequences"][mb * rep["per_mb"] + b]
                p, eng = sj["prompt_lens"][i], np.asarray(sj["engine_logprobs"][i])
                vals.append(np.abs(np.asarray(lp)[p - 1:p - 1 + len(eng)] - eng))
        allv = np.concatenate(vals)
        diffs[name] = {"mean_abs": float(allv.mean()), "p99_abs": float(np.quantile(allv, 0.99)),
                       "max_abs": float(allv.max())}
    return {"samples": len(samples), "prompt_len": a.replay_prompt_len, "new": a.replay_new,
            "route_agreement_replay_off": off_a / off_t, "route_agreement_replay_on": on_a / on_t,
            "decisions": on_t, "logprob_diff_replay_off": diffs["off"], "logprob_diff_replay_on": diffs["on"],
            "trainer_seconds": time.perf_counter() - t}


# -- weight sync -----------------------------------------------------------------------------------
def _engine_gpus(a) -> list[str]:
    return [str(int(a.engine_gpu) + i) for i in range(a.engine_tp)]


def sync_section(url, a, hf: str, out: str, engine_device: str) -> dict:
    path = os.path.join(out, "sync.json")
    tg = a.trainer_gpus.split(",")
    env = dict(os.environ, PYTHONPATH=_pythonpath())
    if not a.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(sorted(set(tg + _engine_gpus(a)), key=int))
        # the worker sees the trainer GPUs first; the raw receivers address the engine GPUs by their index there
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={len(tg)}",
           os.path.join(HERE, "_live_sync_worker.py"), "--hf", hf, "--dtype", a.dtype,
           "--engine", f"{url}@{a.engine_tp}",
           "--engine-device", engine_device, "--reps", str(a.reps), "--out", path,
           *(["--compare-per-bucket"] if a.compare_per_bucket else []),
           *a.sync_layout.replace(",", " ").split()]
    subprocess.run(cmd, env=env, check=True, timeout=900)
    with open(path) as f:
        return json.load(f)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cpu", action="store_true", help="CPU engine and trainer, tiny model (checks the flow)")
    ap.add_argument("--model", default="probe", choices=list(SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="cut the model to this many layers")
    ap.add_argument("--sections", default="rollout,replay,sync")
    ap.add_argument("--engine-gpu", default="1", help="the engine's (first) GPU")
    ap.add_argument("--engine-tp", type=int, default=1,
                    help="engine tensor parallelism, on GPUs engine-gpu, engine-gpu + 1, ...")
    ap.add_argument("--trainer-gpus", default="0")
    ap.add_argument("--mem-fraction", type=float, default=0.6)
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--replay-samples", type=int, default=32)
    ap.add_argument("--replay-prompt-len", type=int, default=128)
    ap.add_argument("--replay-new", type=int, default=256)
    ap.add_argument("--replay-micro-batches", type=int, default=4)
    ap.add_argument("--sync-layout", default="",
                    help="extra layout flags for the sync trainer, e.g. '--tp 2' (or --sync-layout=--tp,2)")
    ap.add_argument("--compare-per-bucket", action="store_true",
                    help="sync: each repetition also with one update request per bucket (A/B)")
    ap.add_argument("--routes-int32", action="store_true",
                    help="the engine sends SGLang's own int32 routes (MRL_COMPACT_ROUTES=0): the baseline for "
                         "mrl's compact routes")
    ap.add_argument("--py-spy", type=int, default=0,
                    help="rollout: sample the engine's processes with py-spy for this many seconds during the "
                         "first repetition's largest batch, routes off and on (where the routes' cost sits)")
    ap.add_argument("--py-spy-bin", default=shutil.which("py-spy") or "py-spy")
    ap.add_argument("--ckpt-root", default=None, help="where the random checkpoint is made or found (default: --out)")
    ap.add_argument("--load-weights", action="store_true",
                    help="the engine loads every weight bucket through the model's load_weights (MRL_REPLAYED_LOAD=0): "
                         "the baseline for mrl's replayed loads")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")

    from mrl.models import get_bridge
    from mrl.rollout.engine import Engine
    from mrl.rollout.secrets import ensure_run_secrets
    from mrl.routing.codec import RoutesCodec

    if a.cpu:
        from mrl.models.tiny import make_tiny_model

        hf = make_tiny_model(os.path.join(a.out, "tiny"))
        a.dtype, engine_device = "fp32", "cpu"
    else:
        name = f"model_{a.model}_{a.layers or 'all'}"
        hf = make_checkpoint(os.path.join(a.ckpt_root or a.out, name), a.model, a.layers)
        a.dtype = "bf16"
        seen = sorted(set(a.trainer_gpus.split(",") + _engine_gpus(a)), key=int)
        engine_device = ",".join(f"cuda:{seen.index(g)}" for g in _engine_gpus(a))
    bridge = get_bridge(hf)
    codec = RoutesCodec.from_bridge(bridge)
    ensure_run_secrets(a.out)
    engine = Engine(model_path=hf, cpu_mode=a.cpu, tp=a.engine_tp, log_dir=os.path.join(a.out, "engines"),
                    name="engine",
                    max_running_requests=max(a.batches + [a.replay_samples]), max_total_tokens=8192 if a.cpu else None,
                    base_gpu_id=int(a.engine_gpu), mem_fraction_static=None if a.cpu else a.mem_fraction,
                    dtype=None if a.cpu else "bfloat16",
                    server_args={} if a.cpu else {"cuda_graph_max_bs": max(a.batches)},
                    env={"MRL_COMPACT_ROUTES": "0" if a.routes_int32 else "1",
                         "MRL_REPLAYED_LOAD": "0" if a.load_weights else "1"})
    report = {"bench": "gpu_loop", "model": a.model, "layers": a.layers or bridge.num_layers, "hf": hf,
              "environment": environment(a.cpu), "args": vars(a)}
    t = time.perf_counter()
    with engine:
        engine.wait_healthy(timeout=900)
        report["engine_start_s"] = time.perf_counter() - t
        report["engine_command"] = " ".join(engine.command()[1:])
        sections = a.sections.split(",")
        for name in sections:
            t = time.perf_counter()
            try:
                if name == "rollout":
                    report["rollout"] = rollout_section(engine.url, codec, bridge.vocab_size, a, engine.proc.pid)
                elif name == "replay":
                    report["replay"] = replay_section(engine.url, codec, bridge.vocab_size, a, hf, a.out)
                elif name == "sync":
                    report["sync"] = sync_section(engine.url, a, hf, a.out, engine_device)
                else:
                    raise ValueError(f"unknown section {name!r}")
            except Exception as e:  # one failing section must not cost the others' figures
                report[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            report.setdefault("section_seconds", {})[name] = time.perf_counter() - t
            with open(os.path.join(a.out, "gpu_loop.json"), "w") as f:
                json.dump(report, f, indent=1)
            print(f"[gpu_loop] {name}: {json.dumps(report[name])[:1500]}", flush=True)
    return 0 if not any("error" in report.get(s, {}) for s in a.sections.split(",")) else 1


if __name__ == "__main__":
    sys.exit(main())
