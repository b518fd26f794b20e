"""The full 48-layer Qwen3-30B-A3B on one GPU, with no checkpoint on disk: an engine and mrl's trainer on the same
synthetic weights, LoRA on attention and every expert, Keep Routing measured at full depth.

    python bench/full_depth.py --mode sequential --out DIR --json R.json    # 80 GB H100: engine, then trainer
    python bench/full_depth.py --mode colocated --out DIR --json R.json     # 139 GB H200: engine beside trainer
    python bench/full_depth.py --cpu --preset tiny --mode sequential --out DIR   # the same flow on CPU

The model's bf16 weights (61 GB) would not fit on the device's disk beside the stack, so only its
``config.json`` is written (``_random_checkpoint.make_config_dir``); every tensor is drawn from (seed, name,
shape) (``mrl.models.synthetic``) by whoever needs it:

1. an SGLang engine starts without weights (``load_format=dummy``), and ``_full_depth_push.py`` draws them on
   the GPU and pushes them bucket by bucket through ``mrl.weight_sync.named`` (CUDA IPC; disk buckets on
   CPU), stamps the version and checks the engine's tensors of the first and last layers bitwise;
2. ``sequential``: the engine samples ``--samples`` responses (groups of 8, random prompts, temperature 1,
   routes and logprobs returned) into ``samples.json`` and stops; then ``_full_depth_trainer.py`` builds
   mrl's ``Policy`` from the same draws (bf16, parameters allocated on the GPU, LoRA, full recompute),
   measures replay off and on over that batch (route agreement per layer, mean |dlogp|, k3 KL, share of
   |dlogp| > 0.5) and takes ``--steps`` LoRA GRPO steps on it, with memory by component;
3. ``colocated``: the engine (memory saver, LoRA slots) stays up beside the trainer, which generates each
   step's batch through it, releases its KV cache while it trains, and loads each new adapter into it
   (``AdapterSync``): ``--steps`` GRPO steps, each phase timed, the first batch's mismatch as above.

One report (``--json``; file names hold ``full_depth``): ``num_hidden_layers``, ``route_agreement_replay_on``,
``route_agreement_replay_off``, ``peak_memory_gib``, ``time_to_first_step_s`` (from this command's start),
``adapter_sync_ms`` (colocated; null in sequential mode: no engine beside the trainer), the engine start,
the push, the rollout, the trainer's figures and ``environment``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(1, ROOT)

from mrl.startup import LAUNCHED_AT  # noqa: E402

os.environ.setdefault(LAUNCHED_AT, repr(time.time()))  # the command's start: time to first step counts from here

from _bench_common import dump, device_name, slug  # noqa: E402
from _random_checkpoint import make_config_dir  # noqa: E402


def overrides(a, hf: str) -> list[str]:
    """The trainer's config (``mrl train``'s composition): the model at ``hf``, LoRA, recompute, micro-batches."""
    targets = ",".join(a.lora_targets)
    # sequential mode starts its engine itself, without LoRA: the trainer's engine section only has to pass the
    # config's LoRA checks (expert adapters need a GPU engine), hence a GPU engine's settings on CPU there
    cpu_engine = ["engine.cpu_mode=true"] if a.mode == "colocated" else ["engine.cpu_mode=false",
                                                                          "engine.dtype=bfloat16"]
    base = ([f"model={'tiny' if a.preset == 'tiny' else 'qwen3_30b_a3b'}", "model.make_tiny_if_missing=false",
             "model.dtype=fp32", *cpu_engine] if a.cpu else ["model=qwen3_30b_a3b", "model.dtype=bf16", "engine=gpu"])
    return [*base, f"model.hf_path={hf}", f"model.lora.rank={a.lora_rank}", f"model.lora.alpha={2 * a.lora_rank}",
            f"model.lora.targets=[{targets}]", f"train.recompute={a.recompute}",
            f"train.micro_batch_size={a.micro_batch_size}", f"rollout.n_samples_per_prompt={a.group}",
            f"engine.lora_slots={a.lora_slots}", *a.set]


def _engine_env(a) -> dict[str, str]:
    from gpu_loop import engine_shim_env

    shim = argparse.Namespace(cpu=a.cpu, routes_int32=False, load_weights=False, load_stream_off=False,
                              sync_profile=False, out=a.out)
    return engine_shim_env(shim)


def engine(a, hf: str, *, lora=None):
    from mrl.engine.launcher import Engine

    inflight = max(a.samples, a.prompts * a.group)
    return Engine(model_path=hf, cpu_mode=a.cpu, tp=1, log_dir=os.path.join(a.out, "engines"), name="engine",
                  load_format="dummy", return_routed_experts=True, max_running_requests=inflight,
                  max_total_tokens=8192 if a.cpu else a.max_total_tokens,
                  mem_fraction_static=None if a.cpu else a.mem_fraction, dtype=None if a.cpu else "bfloat16",
                  memory_saver=a.mode == "colocated" and not a.cpu, lora=lora, env=_engine_env(a),
                  server_args={} if a.cpu else json.loads(a.engine_args))


def run(cmd: list[str], log: str, timeout: float) -> None:
    env = dict(os.environ, PYTHONPATH=ROOT + (":" + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""))
    with open(log, "w") as f:
        p = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    if p.returncode:
        with open(log) as f:
            raise RuntimeError(f"{os.path.basename(cmd[1] if cmd[1] != '-m' else cmd[2])} failed "
                               f"({p.returncode}):\n{f.read()[-4000:]}")


def push(a, hf: str, url: str) -> dict:
    path = os.path.join(a.out, "push.json")
    run([sys.executable, os.path.join(HERE, "_full_depth_push.py"), "--hf", hf, "--seed", str(a.seed), "--url", url,
         "--transport", "disk" if a.cpu else "tensor", "--bucket-mb", str(a.bucket_mb),
         "--export-dir", os.path.join(a.out, "buckets"), "--engine-device", "cpu" if a.cpu else "cuda",
         "--out", path], os.path.join(a.out, "push.log"), timeout=1800)
    with open(path) as f:
        return json.load(f)


def trainer(a, hf: str, extra: list[str]) -> dict:
    path = os.path.join(a.out, "trainer.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           os.path.join(HERE, "_full_depth_trainer.py"), "--hf", hf, "--seed", str(a.seed), "--out", path,
           "--steps", str(a.steps), "--group", str(a.group), *extra, "--", *overrides(a, hf)]
    run(cmd, os.path.join(a.out, "trainer.log"), timeout=3600)
    with open(path) as f:
        return json.load(f)


def sample(a, url: str, hf: str) -> dict:
    """The engine's batch with routes and logprobs (``_rollout_section.workload``), saved for the trainer."""
    from _rollout_section import workload
    from mrl.models import get_bridge
    from mrl.routing.codec import RoutesCodec

    bridge = get_bridge(hf)
    samples, tok_s, seconds, _ = asyncio.run(workload(url, RoutesCodec.from_bridge(bridge), a.samples, a.prompt_len,
                                                      a.new, bridge.vocab_size, seed=a.seed + 123))
    sj = {"sequences": [s.tokens for s in samples], "routes": [s.routes.tolist() for s in samples],
          "engine_logprobs": [s.response_logprobs for s in samples],
          "prompt_lens": [len(s.prompt_ids) for s in samples]}
    with open(os.path.join(a.out, "samples.json"), "w") as f:
        json.dump(sj, f)
    return {"samples": len(samples), "prompt_len": a.prompt_len, "new": a.new, "seconds": seconds,
            "response_tokens_per_s": tok_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=["sequential", "colocated"], required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--json", default=None, help="report path (default: bench/reports/loop/<date>_full_depth_...)")
    ap.add_argument("--cpu", action="store_true", help="CPU engine and trainer (fp32): checks the flow")
    ap.add_argument("--preset", default="qwen3_30b_a3b", help="a _random_checkpoint shape (tiny on CPU)")
    ap.add_argument("--layers", type=int, default=None, help="cut the model to this many layers (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--lora-targets", nargs="+", default=["attention", "experts"])
    ap.add_argument("--lora-slots", type=int, default=2, help="colocated: the engine's adapter slots")
    ap.add_argument("--recompute", default="full", choices=["off", "full", "selective"])
    ap.add_argument("--micro-batch-size", type=int, default=2, help="packed rows per micro-batch")
    ap.add_argument("--steps", type=int, default=3, help="LoRA GRPO steps")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--samples", type=int, default=32, help="sequential: the engine's batch for the mismatch")
    ap.add_argument("--prompts", type=int, default=4, help="colocated: prompts per step (x --group samples)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--bucket-mb", type=float, default=1024, help="the push's buckets (one is all it holds)")
    ap.add_argument("--mem-fraction", type=float, default=None,
                    help="the engine's --mem-fraction-static (default 0.85 sequential, 0.5 colocated)")
    ap.add_argument("--max-total-tokens", type=int, default=32768, help="the engine's KV cache in tokens")
    ap.add_argument("--engine-args", default='{"disable_prefill_cuda_graph": true}', metavar="JSON",
                    help="GPU: more server args; by default no prefill CUDA graphs (their capture is the longest part "
                         "of a 48-layer engine's start, and this job's batches are small)")
    ap.add_argument("--no-release-kv", action="store_true", help="colocated: keep the engine's KV cache in train")
    ap.add_argument("--set", nargs="*", default=[], help="more trainer overrides (mrl train's)")
    a = ap.parse_args()
    if a.mem_fraction is None:
        a.mem_fraction = 0.85 if a.mode == "sequential" else 0.5
    if a.samples % a.group:
        ap.error(f"--samples {a.samples}: a multiple of --group {a.group}")
    os.makedirs(a.out, exist_ok=True)
    os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
    t0 = float(os.environ[LAUNCHED_AT])
    hf = make_config_dir(os.path.join(a.out, f"model_{a.preset}_{a.layers or 'all'}"), a.preset, a.layers)
    from mrl.config.lora_engine import lora_engine_spec
    from mrl.config.load import compose
    from mrl.sglang.keys import ensure_run_secrets

    ensure_run_secrets(a.out)
    cfg = compose(overrides(a, hf))  # the trainer's config, refused here before any engine starts
    rep: dict = {"bench": "full_depth", "mode": a.mode, "preset": a.preset, "args": vars(a),
                 "trainer_overrides": overrides(a, hf)}
    eng = engine(a, hf, lora=lora_engine_spec(cfg) if a.mode == "colocated" else None)
    try:
        eng.start()
        eng.wait_healthy(timeout=1800)
        rep["engine_start_s"] = time.time() - t0
        rep["engine_command"] = " ".join(eng.command()[1:])
        print(f"[full_depth] engine healthy at {rep['engine_start_s']:.1f} s", flush=True)
        rep["push"] = push(a, hf, eng.url)
        rep["push_done_s"] = time.time() - t0
        if a.mode == "sequential":
            rep["rollout"] = sample(a, eng.url, hf)
            eng.stop()  # its memory is the trainer's now
            tr = trainer(a, hf, ["--samples", os.path.join(a.out, "samples.json")])
        else:
            # adapters from tensors: an engine started with load_format=dummy cannot read adapter files (SGLang
            # 0.5.14's LoRA manager keeps the start's load format)
            extra = ["--engine", eng.url, "--prompts", str(a.prompts), "--prompt-len", str(a.prompt_len),
                     "--new", str(a.new)]
            tr = trainer(a, hf, extra + ([] if a.no_release_kv or a.cpu else ["--release-kv"]))
    finally:
        eng.stop()
    mm = tr.get("mismatch", {})
    rep |= {"num_hidden_layers": tr["num_hidden_layers"],
            "route_agreement_replay_on": mm.get("route_agreement_replay_on"),
            "route_agreement_replay_off": mm.get("route_agreement_replay_off"),
            "peak_memory_gib": tr.get("peak_memory_gib"), "time_to_first_step_s": tr["time_to_first_step_s"],
            "adapter_sync_ms": tr.get("adapter_sync_ms"), "trainer": tr}
    dump(rep, a.json, name=f"full_depth_{a.mode}_{a.preset}_l{tr['num_hidden_layers']}_{slug(device_name())}")
    on, off = rep["route_agreement_replay_on"], rep["route_agreement_replay_off"]
    print(f"[full_depth] {a.mode} {tr['num_hidden_layers']} layers: route agreement replay off {off:.4f} on {on:.4f}; "
          f"|dlogp| off {mm['replay_off']['mean_abs_dlogp']:.3e} on {mm['replay_on']['mean_abs_dlogp']:.3e}; "
          f"first step at {rep['time_to_first_step_s']:.1f} s; peak {rep['peak_memory_gib']} GiB; "
          f"adapter sync {rep['adapter_sync_ms']} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
