"""The RL loop's GPU pieces against a live SGLang engine: rollout throughput with and without routes, Keep
Routing (engine vs trainer, replay off and on) and weight sync into the engine vs a raw NCCL broadcast.

    python bench/gpu_loop.py --engine-gpu 1 --trainer-gpus 0 --out DIR          # 2 GPUs, probe model
    python bench/gpu_loop.py --model qwen3_30b_a3b --layers 4 --sections replay --out DIR
    python bench/gpu_loop.py --engine-gpu 2 --engine-tp 2 --trainer-gpus 0,1 --replay-layout=--ep,2 \\
        --sync-layout=--ep,2 --sections replay,sync --out DIR                    # EP2 trainer, TP2 engine
    python bench/gpu_loop.py --engine-gpu 0 --plain-engine-gpu 1 --sections rollout --out DIR
    python bench/gpu_loop.py --cpu --out DIR                                       # the same flow on CPU, tiny model

One engine (mrl's launcher, GPU mode: bf16, triton or FA3 attention, CUDA graphs) serves a random-init
Qwen3-MoE checkpoint (``bench/_random_checkpoint.py``: written tensor by tensor in bf16 shards, so the
full 48-layer Qwen3-30B-A3B shape fits) on ``--engine-gpu`` (and the next ``--engine-tp`` - 1 GPUs);
the trainer side runs on ``--trainer-gpus`` (megatron-core, bf16, NCCL). Sections:

- ``rollout``: GRPO-shaped workloads (groups of 8, one request per sample, random ``--prompt-len``
  prompts, ``--new`` tokens each, temperature 1, ignore_eos) through mrl's RolloutManager at each
  ``--batches`` concurrency, with routes returned and decoded (Keep Routing on) and without, on the
  same engine (started with route capture); with ``--plain-engine-gpu`` also on a second engine
  started at the same time without route capture (the fair baseline: ``routes_on_vs_plain``). The
  kinds alternate within each repetition, in an order that turns from one repetition to the next.
  ``--samples`` beyond the batch makes each run a stream (a finished sample's slot refilled at once, as
  an asynchronous run's engines serve), ``--new-spread`` gives the samples unequal lengths, ``--skip-off``
  leaves out the routes-off runs, ``--engine-args`` / ``--fp8-engine-args`` start the on/off and fp8
  engines with other server args (FA3 for all). Each run also records where its wall time went per
  request (posted, answered, SGLang's own ``e2e_latency``): the spread of the requests' arrivals at the
  engine, the time outside the engine (HTTP both ways), the client's work after the last answer, and the
  seconds outside full-batch decode.
  Also the routes payload of one response as the engine sends it (base64 bytes per token, bytes per
  expert id: 1 with mrl's compact routes, 4 with SGLang's int32 under ``--routes-int32``, the baseline
  to compare with on the same machine).
- ``replay``: ``--replay-samples`` engine samples with their routes and logprobs, then the trainer's
  forward on the same tokens (``tests/jobs/replay_check.py``, one process per trainer GPU in
  ``--replay-layout``) with the routers free (replay off) and replaying the engine's experts (on):
  route agreement per (token, MoE layer) and mean |logprob diff| over the response tokens, over the
  records of every rank.
- ``sync``: ``bench/_live_sync_worker.py`` (trainer in ``--sync-layout``): mrl's weight sync into this
  engine, each repetition followed by a raw broadcast of the same bytes between the same devices; then
  the engine's probe logprobs against the trainer's and a bitwise check of the first and last layer
  (experts included), per engine TP rank.

Everything lands in DIR/gpu_loop.json with every repetition, the hardware and the versions; the last
lines printed are one headline per section.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import datetime
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(1, ROOT)  # tests.jobs.replay_check reads the replay records

from _engine_log import engine_load_lines, engine_timeline  # noqa: E402
from _rollout_section import rollout_section, workload  # noqa: E402
from _random_checkpoint import SHAPES, make_checkpoint  # noqa: E402


def _fp8_run_dir(hf: str) -> str:
    """The run directory next to ``hf`` that holds its block-FP8 export (``_fp8_checkpoint``)."""
    return hf.rstrip("/") + "_fp8run"


def _fp8_checkpoint(hf: str, a) -> tuple[str, dict]:
    """The block-FP8 export of ``hf`` as a run makes it (``mrl.engine.fp8_model``: once, then reused),
    in a run directory next to ``hf``, and what it took."""
    from mrl.engine.fp8_model import MARKER, ensure_fp8_model
    from mrl.models import get_bridge
    from mrl.quant.fp8_targets import sglang_shape_problems

    problems = sglang_shape_problems(get_bridge(hf).hf_config, a.engine_tp)
    if problems:  # SGLang would refuse the export at load, after minutes of start
        raise SystemExit(f"--fp8-engine-gpu: {hf} cannot be served in block FP8: {'; '.join(problems)}")
    t = time.perf_counter()
    dst = ensure_fp8_model(hf, _fp8_run_dir(hf), device=None if a.cpu else "cuda", log=lambda *x: None)
    with open(os.path.join(dst, MARKER)) as f:
        return dst, {"seconds": time.perf_counter() - t, **json.load(f)}


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


def replay_section(url, codec, vocab, a, hf: str, out: str) -> dict:
    """Engine samples, then ``tests.jobs.replay_check`` on ``--trainer-gpus`` (one process each) in
    ``--replay-layout``; every rank's records merged. ``hf``: the trainer's (bf16) checkpoint, whatever
    the engine serves (an FP8 engine serves its block-FP8 export)."""
    os.makedirs(out, exist_ok=True)
    from tests.jobs.replay_check import agreement, logprob_diffs

    samples, _, _, _ = asyncio.run(workload(url, codec, a.replay_samples, a.replay_prompt_len, a.replay_new, vocab,
                                          seed=123))
    sj = {"sequences": [s.tokens for s in samples], "routes": [s.routes.tolist() for s in samples],
          "engine_logprobs": [s.response_logprobs for s in samples],
          "prompt_lens": [len(s.prompt_ids) for s in samples]}
    path = os.path.join(out, "replay_samples.json")
    with open(path, "w") as f:
        json.dump(sj, f)
    rdir = os.path.join(out, "replay")
    shutil.rmtree(rdir, ignore_errors=True)  # no rank file of an earlier run may be merged in
    gpus = a.trainer_gpus.split(",")
    layout = a.replay_layout.replace(",", " ").split()
    env = dict(os.environ, PYTHONPATH=_pythonpath())
    if not a.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={len(gpus)}", "-m",
           "tests.jobs.replay_check", "--hf", hf, "--input", path, "--out", rdir, "--dtype", a.dtype,
           "--micro-batches", str(a.replay_micro_batches), *layout]
    t = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, timeout=1800)
    reps = []
    for r in range(len(gpus)):
        with open(os.path.join(rdir, f"rank{r}.json")) as f:
            reps.append(json.load(f))
    on_a, on_t = agreement(sj, reps, "forward_calls")
    off_a, off_t = agreement(sj, reps, "natural_calls")
    return {"samples": len(samples), "prompt_len": a.replay_prompt_len, "new": a.replay_new,
            "trainer_layout": " ".join(layout) or "tp1", "trainer_ranks": len(gpus),
            "route_agreement_replay_off": off_a / off_t, "route_agreement_replay_on": on_a / on_t,
            "decisions": on_t, "decisions_replay_off": off_t,
            "logprob_diff_replay_off": logprob_diffs(sj, reps, "logprobs_natural"),
            "logprob_diff_replay_on": logprob_diffs(sj, reps, "logprobs_replay"),
            "trainer_seconds": time.perf_counter() - t}


# -- engines and headlines -------------------------------------------------------------------------
def _engine(a, hf: str, name: str, routes: bool, gpu: str, *, quantization: str | None = None,
            server_args: dict | None = None):
    """One SGLang server on ``gpu`` (its first GPU at ``--engine-tp`` > 1); ``routes``: route capture on
    (``--enable-return-routed-experts``), the only difference between the routes and the plain engine.
    ``quantization``/``server_args``: what an FP8 engine or a start variant changes (``hf``: its checkpoint;
    a ``kv_cache_dtype``, ``attention_backend`` or ``moe_kernel_configs`` among the server args goes to
    the engine's own field, as the rollout config's would)."""
    server_args = dict(server_args or {})
    kv_cache_dtype = server_args.pop("kv_cache_dtype", None)
    attention_backend = server_args.pop("attention_backend", None)  # mrl's own flag, not a second one
    moe_kernel_configs = server_args.pop("moe_kernel_configs", None)  # `mrl tune-moe` tables
    extra_path = server_args.pop("mrl_pythonpath", None)  # e.g. the stack's DeepGEMM, off the default path
    extra_env = server_args.pop("mrl_env", {})
    from mrl.engine.launcher import Engine

    env = engine_shim_env(a, extra_path)
    env |= {str(k): str(v) for k, v in extra_env.items()}
    env |= dict(kv.split("=", 1) for kv in a.engine_env)
    return Engine(model_path=hf, cpu_mode=a.cpu, tp=a.engine_tp, log_dir=os.path.join(a.out, "engines"), name=name,
                  max_running_requests=max(a.batches + [a.replay_samples]),
                  max_total_tokens=8192 if a.cpu else a.max_total_tokens,
                  base_gpu_id=int(gpu), mem_fraction_static=None if a.cpu else a.mem_fraction,
                  dtype=None if a.cpu else "bfloat16", return_routed_experts=routes, quantization=quantization,
                  kv_cache_dtype=kv_cache_dtype, attention_backend=attention_backend,
                  moe_kernel_configs=moe_kernel_configs,
                  server_args=({} if a.cpu else {"cuda_graph_max_bs": max(a.batches)}) | server_args, env=env)


def engine_shim_env(a, extra_path: str | None = None) -> dict[str, str]:
    """The bench's engine shim (``bench/_engine_shim``) before mrl's on the engine's path, and what it installs:
    the baselines asked for (``--routes-int32``, ``--load-weights``, ``--load-stream-off``), the update figures
    (``--sync-profile``) and, on CPU, the no-op ``torch.cuda.synchronize`` of the bitwise check's checksums."""
    from mrl.engine import gpu_mode
    from mrl.engine.cpu_mode import PYSHIM_DIR

    shim = os.path.join(HERE, "_engine_shim")
    mrl_path = f"{PYSHIM_DIR}:{_pythonpath()}" if a.cpu else gpu_mode.gpu_env()["PYTHONPATH"]
    env = {"PYTHONPATH": ":".join(p for p in (shim, "" if a.cpu else extra_path, mrl_path) if p)}
    baseline = [b for b, on in (("compact_routes", a.routes_int32), ("replayed_load", a.load_weights),
                                ("load_stream", a.load_stream_off)) if on]
    if baseline:
        env["BENCH_BASELINE"] = ",".join(baseline)
    if a.sync_profile:
        os.makedirs(_profile_dir(a), exist_ok=True)
        env["BENCH_SYNC_STATS_DIR"] = _profile_dir(a)
    if a.cpu:
        env["BENCH_CPU_ENGINE"] = "1"
    return env


def _wait_healthy(engine, timeout: float) -> float:
    """Seconds from now until ``engine`` answers (the engines were started just before)."""
    t = time.perf_counter()
    engine.wait_healthy(timeout=timeout)
    return time.perf_counter() - t


def _start_or_drop(engines: dict, name: str, report: dict, timeout: float) -> float | None:
    """Seconds until engine ``name`` is healthy; an engine other than the routes one that does not start
    within ``timeout`` (a start variant SGLang refuses, or one whose kernels compile for longer than the
    run can wait) is stopped, dropped and its error reported, the others' figures kept."""
    try:
        return _wait_healthy(engines[name], timeout)
    except Exception as e:
        if name == "routes":
            raise
        report[f"{name}_engine_error"] = f"{type(e).__name__}: {e}"[:1000]
        print(f"[gpu_loop] engine {name} did not start, left out: {report[f'{name}_engine_error'][:300]}", flush=True)
        engines.pop(name).stop()
        return None


def headline(report: dict, name: str) -> str:
    """One line of a section's figures."""
    r = report.get(name, {})
    if "error" in r:
        return f"[{name}] ERROR {r['error'][:300]}"
    if name == "rollout":
        parts = []
        for b, s in r["summary"].items():
            x = [f"on {s['routes_on_median']:.0f} tok/s"]
            if "on_vs_off_median" in s:
                x.append(f"on/off {s['on_vs_off_median']:.3f} ({s['on_vs_off_min']:.3f}-{s['on_vs_off_max']:.3f})")
            if "routes_on_vs_plain_median" in s:
                x.append(f"on/plain {s['routes_on_vs_plain_median']:.3f} ({s['routes_on_vs_plain_min']:.3f}-"
                         f"{s['routes_on_vs_plain_max']:.3f}), plain {s['plain_median']:.0f} tok/s")
            for k in (k for k in r["kinds"] if k not in ("off", "on", "plain")):
                x.append(f"{k}/on {s[f'{k}_vs_on_median']:.3f} ({s[f'{k}_vs_on_min']:.3f}-{s[f'{k}_vs_on_max']:.3f})")
                if f"{k}_decode_vs_on_median" in s:
                    x[-1] += f" [decode alone {s[f'{k}_decode_vs_on_median']:.3f}]"
            for p in r.get("pairs", []):
                num, den = p.split(":")
                if f"{num}_vs_{den}_median" in s:
                    x.append(f"{num}/{den} {s[f'{num}_vs_{den}_median']:.3f}")
            parts.append(f"{b}: " + ", ".join(x))
        starts = ", ".join(f"{k.removesuffix('_engine_start_s')} {v:.0f} s" for k, v in r.items()
                           if k.endswith("_engine_start_s"))
        return f"[rollout] {'; '.join(parts)}; engine start {starts}"
    if name.startswith("replay"):
        return (f"[{name}] {r['trainer_layout']} x{r['trainer_ranks']}: route agreement off "
                f"{r['route_agreement_replay_off']:.4f} on {r['route_agreement_replay_on']:.4f} "
                f"({r['decisions']} decisions); mean |dlogp| off {r['logprob_diff_replay_off']['mean_abs']:.2e} "
                f"on {r['logprob_diff_replay_on']['mean_abs']:.2e} (max {r['logprob_diff_replay_on']['max_abs']:.2e})")
    if name == "sync":
        bw = r.get("bitwise_sampled_tensors", {})
        bits = (f"{bw['equal']}/{bw['compared']} equal" if "compared" in bw else f"error {bw.get('error', '')[:120]}")
        line = (f"[sync] {r['bytes'] / 1e9:.3f} GB in {r['sync_median_s']:.4f} s (raw {r['raw_median_s']:.4f} s, "
                f"sync/raw {r['sync_vs_raw']:.2f}), engine tp{r['engine_tp']} <- {r['trainer_ranks']} trainer ranks; "
                f"bitwise {bits}; probe max |dlogp| {r['probe_max_abs_logprob_diff']:.2e}")
        for rank, e in r.get("profile", {}).get("engine", {}).items():
            tot = e.get("measured", {}).get("per_sync_total_s", {})
            line += f"\n[sync] engine {rank} per sync: " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(tot.items()))
            if e.get("request_latency_s"):
                line += f"; request to runner {e['request_latency_s']['median']:.4f} s"
        return line
    return f"[{name}] {json.dumps(r)[:300]}"


# -- weight sync -----------------------------------------------------------------------------------
def _profile_dir(a) -> str:
    return os.path.join(os.path.abspath(a.out), "sync_profile")


def _engine_gpus(a) -> list[str]:
    return [str(int(a.engine_gpu) + i) for i in range(a.engine_tp)]


def sync_section(url, a, hf: str, out: str, engine_device: str, fp8_url: str | None = None) -> dict:
    """``fp8_url``: the FP8 engine, synced in each repetition after the bf16 one (``--fp8-engine-gpu``)."""
    path = os.path.join(out, "sync.json")
    tg = a.trainer_gpus.split(",")
    env = dict(os.environ, PYTHONPATH=_pythonpath())
    if not a.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(sorted(set(tg + _engine_gpus(a)), key=int))
        # the worker sees the trainer GPUs first; the raw receivers address the engine GPUs by their index there
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={len(tg)}",
           os.path.join(HERE, "_live_sync_worker.py"), "--hf", hf, "--dtype", a.dtype,
           "--engine", f"{url}@{a.engine_tp}",
           "--engine-device", engine_device, "--reps", str(a.reps), "--out", path, "--bucket-mb", str(a.bucket_mb),
           *(["--compare-per-bucket"] if a.compare_per_bucket else []),
           *(["--profile-dir", _profile_dir(a)] if a.sync_profile else []),
           "--transport", a.sync_transport, *(["--fp8-engine", f"{fp8_url}@{a.engine_tp}"] if fp8_url else []),
           *a.sync_layout.replace(",", " ").split()]
    subprocess.run(cmd, env=env, check=True, timeout=900)
    with open(path) as f:
        report = json.load(f)
    report["engine_load_lines"] = engine_load_lines(os.path.join(a.out, "engines"))
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cpu", action="store_true", help="CPU engine and trainer, tiny model (checks the flow)")
    ap.add_argument("--model", default="probe", choices=[k for k in SHAPES if k != "tiny"])
    ap.add_argument("--layers", type=int, default=None, help="cut the model to this many layers")
    ap.add_argument("--cpu-model", default="tiny", choices=list(SHAPES),
                    help="--cpu: the checkpoint's shape (cpu_wide: 64 experts, for per-tensor costs)")
    ap.add_argument("--bucket-mb", type=float, default=512, help="sync: weight_sync.bucket_mb")
    ap.add_argument("--sections", default="rollout,replay,sync")
    ap.add_argument("--engine-gpu", default="1", help="the engine's (first) GPU")
    ap.add_argument("--engine-tp", type=int, default=1,
                    help="engine tensor parallelism, on GPUs engine-gpu, engine-gpu + 1, ...")
    ap.add_argument("--trainer-gpus", default="0")
    ap.add_argument("--mem-fraction", type=float, default=0.6)
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--samples", type=int, default=None,
                    help="rollout: samples per run (default: the batch); more than the batch makes each run a "
                         "stream at that many in flight, a finished sample's slot refilled at once, as an "
                         "asynchronous run's engines see it (the batch's start and tail once per run, not per batch)")
    ap.add_argument("--new-spread", type=float, default=0.0,
                    help="rollout: each sample's new tokens drawn uniformly from new x [1 - F, 1 + F] (the same "
                         "draws for every kind of a repetition): responses of RL's unequal lengths")
    ap.add_argument("--skip-off", action="store_true",
                    help="rollout: no routes-off runs (mrl requests routes whenever Keep Routing is on)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--replay-samples", type=int, default=32)
    ap.add_argument("--replay-prompt-len", type=int, default=128)
    ap.add_argument("--replay-new", type=int, default=256)
    ap.add_argument("--replay-micro-batches", type=int, default=4)
    ap.add_argument("--replay-layout", default="",
                    help="layout flags for the replay trainer, one process per --trainer-gpus entry, e.g. '--ep 2' "
                         "(or --replay-layout=--ep,2); default TP1")
    ap.add_argument("--plain-engine-gpu", default=None,
                    help="rollout: also start an engine without route capture on this (first) GPU, the baseline "
                         "for routes on (ignored on CPU except that the engine is started)")
    ap.add_argument("--fp8-engine-gpu", default=None,
                    help="also start an engine on the block-FP8 export of the checkpoint (mrl export-fp8, routes "
                         "captured) on this (first) GPU: rollout kind fp8 against on (bf16), and Keep Routing "
                         "replay_fp8 (trainer bf16 vs FP8 engine)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                    help="rollout: also an engine started with these extra server args (routes captured), on "
                         "--variant-gpu, e.g. noprefill='{\"disable_prefill_cuda_graph\": true}': kind NAME "
                         "against on, its start phases from its log")
    ap.add_argument("--engine-args", default="{}", metavar="JSON",
                    help="server args for the routes (and plain) engine, as --variant's: e.g. FA3 for the "
                         "baseline kinds on/off themselves")
    ap.add_argument("--fp8-engine-args", default="{}", metavar="JSON",
                    help="server args for the --fp8-engine-gpu engine, as --fp8-variant's")
    ap.add_argument("--fp8-variant", action="append", default=[], metavar="NAME=JSON",
                    help="rollout: one more FP8 engine (the --fp8-engine-gpu export, on that GPU) with these "
                         "server args, e.g. fp8cutlass='{\"moe_runner_backend\":\"cutlass\"}' or "
                         "fp8kv='{\"kv_cache_dtype\":\"fp8_e4m3\"}'; two keys are not server args: "
                         "mrl_pythonpath (prepended to the engine's PYTHONPATH, e.g. the stack's deepgemm "
                         "folder) and mrl_env (more environment)")
    ap.add_argument("--pair", action="append", default=[], metavar="NUM:DEN",
                    help="rollout: also the per-repetition ratio of two kinds other than on/off, e.g. "
                         "fp8fa3np:fa3np (an FP8 engine against the bf16 engine with the same server args)")
    ap.add_argument("--sync-transport", default="distributed", choices=["distributed", "tensor"],
                    help="sync: tensor = CUDA IPC into engines on the trainer's GPU (one GPU for all)")
    ap.add_argument("--variant-gpu", default=None, help="--variant engines' (first) GPU (default --engine-gpu)")
    ap.add_argument("--start-one-by-one", action="store_true",
                    help="start each engine once the one before is healthy (engines sharing one GPU)")
    ap.add_argument("--start-timeout", type=float, default=1800,
                    help="seconds an engine may take to become healthy; a compared engine (not the routes one) "
                         "that takes longer is dropped from the run, e.g. one that JIT-compiles DeepGEMM kernels")
    ap.add_argument("--max-total-tokens", type=int, default=None,
                    help="GPU: every engine's KV cache in tokens (engines sharing a GPU get equal caches)")
    ap.add_argument("--sync-layout", default="",
                    help="extra layout flags for the sync trainer, e.g. '--tp 2' (or --sync-layout=--tp,2)")
    ap.add_argument("--compare-per-bucket", action="store_true",
                    help="sync: each repetition also with one update request per bucket (A/B)")
    ap.add_argument("--sync-profile", action="store_true",
                    help="sync: after the timed syncs (run without it), as many more with per-bucket seconds on "
                         "every trainer rank and engine TP rank (the engine's from bench/_update_stats.py: waiting for "
                         "a buffer, receiving, loading, on GPU device seconds too; its load path and copy counts; "
                         "the request's latency to the model runner), then one more sync under torch.profiler "
                         "(CPU + CUDA) on each; traces in OUT/sync_profile, summary under sync.profile")
    ap.add_argument("--routes-int32", action="store_true",
                    help="the engine sends SGLang's own int32 routes (mrl's compact routes left out by the "
                         "bench's engine shim): their baseline")
    ap.add_argument("--py-spy", type=int, default=0,
                    help="rollout: sample the engine's processes with py-spy for this many seconds during the "
                         "first repetition's largest batch, routes off and on (where the routes' cost sits)")
    ap.add_argument("--py-spy-bin", default=shutil.which("py-spy") or "py-spy")
    ap.add_argument("--engine-profile", type=int, default=0, metavar="STEPS",
                    help="rollout: after the timed runs, one more of the largest batch per kind with SGLang's "
                         "profiler on this many forward steps, kernel time summed by category (0: off)")
    ap.add_argument("--engine-profile-delay", type=float, default=1.5,
                    help="seconds into that run before the profiled steps (past the prefills)")
    ap.add_argument("--ckpt-root", default=None, help="where the random checkpoint is made or found (default: --out)")
    ap.add_argument("--remove-checkpoints", action="store_true",
                    help="delete the random checkpoint and its FP8 export when the run ends")
    ap.add_argument("--engine-env", action="append", default=[], metavar="KEY=VALUE",
                    help="more environment for every engine this run starts")
    ap.add_argument("--load-weights", action="store_true",
                    help="the engine loads every weight bucket through the model's load_weights (mrl's replayed "
                         "loads left out by the bench's engine shim): their baseline")
    ap.add_argument("--load-stream-off", action="store_true",
                    help="a batched update's copies run on the engine's receiving stream, after each receive: the "
                         "baseline for mrl's load stream")
    a = ap.parse_args()
    if any("=" not in kv for kv in a.engine_env):
        ap.error(f"--engine-env takes KEY=VALUE: got {a.engine_env}")
    if a.samples is not None and (a.samples < max(a.batches) or a.samples % 8):
        ap.error(f"--samples {a.samples}: give a multiple of 8 (groups of 8) of at least the batch ({max(a.batches)})")
    if not 0 <= a.new_spread < 1:
        ap.error(f"--new-spread {a.new_spread}: give a fraction in [0, 1)")
    try:
        engine_args, fp8_engine_args = json.loads(a.engine_args), json.loads(a.fp8_engine_args)
    except ValueError as e:
        ap.error(f"--engine-args / --fp8-engine-args: not JSON: {e}")
    if a.py_spy and not shutil.which(a.py_spy_bin):
        ap.error(f"--py-spy: no py-spy at {a.py_spy_bin!r} (give --py-spy-bin)")
    named = {"on", *([] if a.skip_off else ["off"]), *(["plain"] if a.plain_engine_gpu is not None else []),
             *(["fp8"] if a.fp8_engine_gpu is not None else []),
             *(v.partition("=")[0] for v in a.variant + a.fp8_variant)}
    for p in a.pair:
        num, sep, den = p.partition(":")
        if not sep or num not in named or den not in named:
            ap.error(f"--pair {p!r}: give NUM:DEN, two of the run's kinds {sorted(named)}")
    os.makedirs(a.out, exist_ok=True)
    os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")

    from mrl.models import get_bridge
    from mrl.routing.codec import RoutesCodec

    if a.cpu:  # the GPU flow's checkpoint writer, in several shards, at the tiny preset's shape
        hf = make_checkpoint(os.path.join(a.out, f"model_{a.cpu_model}_{a.layers or 'all'}"), a.cpu_model, a.layers,
                             shard_gb=0.0001 if a.cpu_model == "tiny" else 0.01)
        a.dtype, engine_device = "fp32", ",".join(["cpu"] * a.engine_tp)  # a raw receiver per engine rank
    else:
        name = f"model_{a.model}_{a.layers or 'all'}"
        hf = make_checkpoint(os.path.join(a.ckpt_root or a.out, name), a.model, a.layers)
        a.dtype = "bf16"
        seen = sorted(set(a.trainer_gpus.split(",") + _engine_gpus(a)), key=int)
        engine_device = ",".join(f"cuda:{seen.index(g)}" for g in _engine_gpus(a))
    bridge = get_bridge(hf)
    codec = RoutesCodec.from_bridge(bridge)
    engines = {"routes": _engine(a, hf, "engine", True, a.engine_gpu, server_args=engine_args)}
    if a.plain_engine_gpu is not None and "rollout" in a.sections.split(","):
        engines["plain"] = _engine(a, hf, "plain_engine", False, a.plain_engine_gpu, server_args=engine_args)
    fp8_export = None
    if a.fp8_engine_gpu is not None:
        fp8_hf, fp8_export = _fp8_checkpoint(hf, a)
        engines["fp8"] = _engine(a, fp8_hf, "fp8_engine", True, a.fp8_engine_gpu, quantization="fp8",
                                 server_args=fp8_engine_args)
    for v in a.variant:
        name, _, args = v.partition("=")
        engines[name] = _engine(a, hf, f"{name}_engine", True, a.variant_gpu or a.engine_gpu,
                                server_args=json.loads(args))
    if a.fp8_variant and a.fp8_engine_gpu is None:
        ap.error("--fp8-variant starts engines from the --fp8-engine-gpu export: give --fp8-engine-gpu")
    for v in a.fp8_variant:
        name, _, args = v.partition("=")
        engines[name] = _engine(a, fp8_hf, f"{name}_engine", True, a.fp8_engine_gpu, quantization="fp8",
                                server_args=json.loads(args))
    report = {"bench": "gpu_loop", "model": a.cpu_model if a.cpu else a.model, "layers": a.layers or bridge.num_layers,
              "hf": hf, "checkpoint_files": sorted(f for f in os.listdir(hf) if f.endswith(".safetensors")),
              "environment": environment(a.cpu), "args": vars(a), "fp8_export": fp8_export}
    with contextlib.ExitStack() as stack:
        if a.start_one_by_one:  # engines sharing a GPU: each sizes its KV cache by the memory free when it starts
            starts = {}
            for k, e in list(engines.items()):
                stack.enter_context(e)
                starts[k] = _start_or_drop(engines, k, report, a.start_timeout)
        else:
            for e in engines.values():
                stack.enter_context(e)  # started together, each one's seconds to healthy timed on its own
            with concurrent.futures.ThreadPoolExecutor(len(engines)) as pool:
                starts = dict(zip(engines, pool.map(lambda k: _start_or_drop(engines, k, report, a.start_timeout),
                                                               list(engines))))
        starts = {k: v for k, v in starts.items() if v is not None}
        report["engine_start_s"] = starts["routes"]
        report["engine_command"] = " ".join(engines["routes"].command()[1:])
        for k in engines.keys() - {"routes"}:
            report[f"{k}_engine_start_s"] = starts[k]
            report[f"{k}_engine_command"] = " ".join(engines[k].command()[1:])
        print("[gpu_loop] engines healthy: " + ", ".join(f"{k} {v:.1f} s" for k, v in starts.items()), flush=True)
        url = engines["routes"].url
        for name in a.sections.split(","):
            t = time.perf_counter()
            try:
                if name == "rollout":
                    report["rollout"] = rollout_section({k: e.url for k, e in engines.items()}, codec,
                                                        bridge.vocab_size, a,
                                                        {k: e.proc.pid for k, e in engines.items()},
                                                        {k: e.log_path for k, e in engines.items()})
                    for k, v in starts.items():
                        report["rollout"][f"{k}_engine_start_s"] = v
                    for k in engines.keys() - {"routes", "fp8"}:
                        engines[k].stop()  # only rollout uses them: their GPUs are free for the sections after
                elif name == "replay":
                    report["replay"] = replay_section(url, codec, bridge.vocab_size, a, hf, a.out)
                    if "fp8" in engines:
                        report["replay_fp8"] = replay_section(engines["fp8"].url, codec, bridge.vocab_size, a, hf,
                                                              os.path.join(a.out, "fp8"))
                elif name == "sync":
                    report["sync"] = sync_section(url, a, hf, a.out, engine_device,
                                                  engines["fp8"].url if "fp8" in engines else None)
                else:
                    raise ValueError(f"unknown section {name!r}")
            except Exception as e:  # one failing section must not cost the others' figures
                report[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            report.setdefault("section_seconds", {})[name] = time.perf_counter() - t
            with open(os.path.join(a.out, "gpu_loop.json"), "w") as f:
                json.dump(report, f, indent=1)
            print(f"[gpu_loop] {name}: {json.dumps(report[name])[:1500]}", flush=True)
        report["engine_log_timeline"] = engine_timeline(os.path.join(a.out, "engines"))
        with open(os.path.join(a.out, "gpu_loop.json"), "w") as f:
            json.dump(report, f, indent=1)
    if a.remove_checkpoints:  # scratch weights: the next run on a small disk makes its own
        for path in (hf, _fp8_run_dir(hf)):
            shutil.rmtree(path, ignore_errors=True)
    shown = [n for n in a.sections.split(",")] + (["replay_fp8"] if "replay_fp8" in report else [])
    print("\n".join(headline(report, name) for name in shown), flush=True)
    return 0 if not any("error" in report.get(s, {}) for s in a.sections.split(",")) else 1


if __name__ == "__main__":
    sys.exit(main())
