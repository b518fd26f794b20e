"""Weight-sync time / raw broadcast time of the same bytes over the same groups, measured in one run.

    python bench/weight_sync_bench.py                         # CPU (gloo): tiny model (1.2 MiB), receivers on CPU
    python bench/weight_sync_bench.py --scale cpu-large       # CPU (gloo): 186 MiB fp32 (throughput, not fixed costs)
    python bench/weight_sync_bench.py --scale gpu --receivers 2 --layouts tp2 ep2   # GPUs (NCCL), 1.67 GiB bf16

Trainer ranks run mrl's real executor (TP/EP gathers, HF conversion, flattened buckets, HTTP
metadata); the receivers follow SGLang's weight-update protocol (bench/weight_receiver.py). The
raw baseline broadcasts each sender's total bytes as one buffer over the same group (one request per
receiver, posted by trainer rank 0, listing the groups in one order; see weight_receiver.py for the
NCCL deadlock that per-sender requests caused). The trainer ranks hold their params in megatron's
DDP parameter buffer, as in training, so buckets of params stored back to back in HF form go out
without a copy ("in place %"; the variant ``+MRL_BENCH_NO_DDP=1`` copies every bucket). Sync and raw
repetitions are interleaved after one
warm-up of each. Each layout has a time limit (--timeout): past it the workers and the receivers dump
every thread's stack into the printed logs, and the next layout runs. Two more columns say where the
time goes: the copy plan alone (gathers and copies of every bucket, no broadcast) and the sync with the
copies left out (broadcasts and per-bucket requests only). With several senders on CPU, "sync/raw
serial" divides by the raw bytes received one group after the other: an engine on gloo blocks in each
weight request, so it cannot take two senders' broadcasts at once, while the raw baseline does.
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import torch
from rich.console import Console
from rich.table import Table

from _bench_common import dump, slug

HERE = os.path.dirname(os.path.abspath(__file__))
LAYOUTS = {"tp1": (1, []), "tp2": (2, ["--tp", "2"]), "ep2": (2, ["--ep", "2"]),
           "tp2ep2": (2, ["--tp", "2", "--ep", "2", "--etp", "1"]), "pp2": (2, ["--pp", "2"])}
SENDERS = {"tp1": {0}, "tp2": {0}, "ep2": {0, 1}, "tp2ep2": {0, 1}, "pp2": {0, 1}}  # trainer ranks that broadcast


def split_variant(name: str) -> tuple[str, dict[str, str]]:
    """``tp1+MRL_BENCH_NO_DDP=1`` -> ("tp1", {env of its workers})."""
    base, *env = name.split("+")
    return base, dict(e.split("=", 1) for e in env)
# >= 1 GiB in bf16 (~0.84 B params): 8 layers, 64 experts of 1024x512, vocab 32768
GPU_MODEL = dict(vocab_size=32768, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
                 num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=64,
                 num_experts_per_tok=8, norm_topk_prob=True, tie_word_embeddings=False, rope_theta=1e6,
                 rms_norm_eps=1e-6, max_position_embeddings=4096)
# 186 MiB in fp32 (48.8 M params, 423 HF tensors): 4 layers, 32 experts of 192x512, vocab 8192
CPU_LARGE_MODEL = dict(vocab_size=8192, hidden_size=512, intermediate_size=1024, moe_intermediate_size=192,
                       num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_experts=32,
                       num_experts_per_tok=4, norm_topk_prob=True, tie_word_embeddings=False, rope_theta=1e6,
                       rms_norm_eps=1e-6, max_position_embeddings=4096)
SCALES = {  # scale -> (model description, trainer dtype, default bucket MiB)
    "cpu": ("stress_a tiny, 1.2 MiB fp32 (fixed costs)", "fp32", [0.125, 2]),
    "cpu-large": ("Qwen3-MoE 4 layers x 32 experts, 186 MiB fp32", "fp32", [16, 64]),
    "gpu": ("Qwen3-MoE 8 layers x 64 experts, 1.67 GiB bf16", "bf16", [256]),
}


def make_model(scale: str, root: str) -> str:
    if scale == "cpu":
        from mrl.config.schema import TinyPreset
        from mrl.models.tiny import make_tiny_model

        return make_tiny_model(os.path.join(root, "stress_a"), TinyPreset.stress_a)
    from safetensors.torch import save_file
    from transformers import Qwen3MoeConfig

    from mrl.models.qwen3_moe import Qwen3MoeBridge

    preset, dtype = (GPU_MODEL, torch.bfloat16) if scale == "gpu" else (CPU_LARGE_MODEL, torch.float32)
    path = os.path.join(root, f"{scale}_moe")
    os.makedirs(path, exist_ok=True)
    cfg = Qwen3MoeConfig(architectures=["Qwen3MoeForCausalLM"], **preset)
    cfg.save_pretrained(path)
    shapes = Qwen3MoeBridge(cfg).hf_tensor_shapes(preset["vocab_size"])
    g = torch.Generator().manual_seed(0)
    save_file({n: (torch.randn(s, generator=g) * 0.02).to(dtype) for n, s in shapes.items()},
              os.path.join(path, "model.safetensors"))
    return path


def start_receivers(n: int, devices: list[str], root: str, tag: str):
    procs, urls, logs = [], [], []
    for i in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        path = os.path.join(root, f"receiver_{tag}_{i}.log")
        log = open(path, "w")
        procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, "weight_receiver.py"), "--port", str(port),
                                       "--device", devices[i]], stdout=log, stderr=subprocess.STDOUT))
        urls.append(f"http://127.0.0.1:{port}")
        logs.append(path)
    for u, p in zip(urls, procs):
        for _ in range(240):
            if p.poll() is not None:
                raise SystemExit(f"receiver {u} exited with {p.returncode}")
            try:
                httpx.get(u + "/model_info", timeout=2)
                break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            raise SystemExit(f"receiver {u} did not come up")
    return procs, urls, logs


def _tail(path: str, n: int = 60) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def receiver_devices(name: str, n: int) -> list[str]:
    """GPUs of the receivers: free GPUs first, then GPUs of trainer ranks that never broadcast (a
    weight-update group cannot hold two ranks on one GPU). Raises when the layout does not fit."""
    name = split_variant(name)[0]
    nproc = LAYOUTS[name][0]
    free = list(range(nproc, torch.cuda.device_count())) + [r for r in range(nproc) if r not in SENDERS[name]]
    if len(free) < n:
        raise RuntimeError(f"{name} with {n} receiver(s) needs {nproc + n} GPUs, or senders on fewer ranks "
                           f"({torch.cuda.device_count()} GPUs here)")
    return [f"cuda:{g}" for g in free[:n]]


def run_layout(name: str, a, hf: str, dtype: str, buckets: list[float], root: str) -> list[dict] | None:
    """One layout: fresh receivers, one torchrun; on a timeout every process dumps its stacks."""
    base, variant_env = split_variant(name)
    nproc, args = LAYOUTS[base]
    devices = receiver_devices(name, a.receivers) if a.scale == "gpu" else ["cpu"] * a.receivers
    procs, urls, logs = start_receivers(a.receivers, devices, root, name)
    out = os.path.join(root, f"{name}.json")
    wlog_path = os.path.join(root, f"workers_{name}.log")
    env = dict(os.environ, OMP_NUM_THREADS="1", **variant_env)
    if a.timeout:  # the workers dump their stacks a little before we give up on them
        env.setdefault("MRL_DUMP_AFTER", str(max(10, a.timeout - 15)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.join(HERE, "_sync_worker.py"), "--hf", hf, "--dtype", dtype, "--engines",
           ",".join(f"{u}@1" for u in urls), "--bucket-mb", *map(str, buckets), "--reps", str(a.reps),
           "--out", out, *args]
    try:
        with open(wlog_path, "w") as wlog:
            w = subprocess.Popen(cmd, stdout=wlog, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                rc = w.wait(timeout=a.timeout or None)
            except subprocess.TimeoutExpired:
                rc = None
                for p in procs:  # receivers: stacks of every thread (faulthandler on SIGUSR1)
                    p.send_signal(signal.SIGUSR1)
                time.sleep(3)
                os.killpg(w.pid, signal.SIGKILL)
                w.wait()
        if rc == 0:
            return json.load(open(out))["runs"]
        print(f"== {name}: {'TIMED OUT after %ss' % a.timeout if rc is None else 'exit code %s' % rc}")
        print(f"-- workers ({wlog_path}):\n{_tail(wlog_path, 120)}")
        for lp in logs:
            print(f"-- {lp}:\n{_tail(lp)}")
        return None
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", choices=list(SCALES), default="cpu")
    ap.add_argument("--receivers", type=int, default=1)
    ap.add_argument("--layouts", nargs="+", default=["tp1", "tp2", "ep2", "tp2ep2", "pp2"],
                    help="layout names, each optionally with +ENV=VALUE settings of its workers (a variant), e.g. "
                         "tp1+MRL_BENCH_NO_DDP=1 (params left as loaded, not in a DDP buffer: bench/_sync_worker.py)")
    ap.add_argument("--bucket-mb", type=float, nargs="+", default=None,
                    help="bucket sizes (MiB), each timed on the same loaded model (default: per scale, SCALES)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=300, help="seconds per layout (0: none)")
    ap.add_argument("--json", default=None, help="report path (default: bench/reports/<topic>/<date>_<name>.json)")
    a = ap.parse_args()
    root = tempfile.mkdtemp(prefix="mrl_sync_bench_")
    hf = make_model(a.scale, root)
    model_desc, dtype, default_buckets = SCALES[a.scale]
    buckets = a.bucket_mb or default_buckets
    rows, failed, skipped = [], [], []
    for name in a.layouts:
        try:
            devices = receiver_devices(name, a.receivers) if a.scale == "gpu" else ["cpu"] * a.receivers
        except RuntimeError as e:
            print(f"== {name}: skipped: {e}")
            skipped.append(name)
            continue
        runs = run_layout(name, a, hf, dtype, buckets, root)
        if runs is None:
            failed.append(name)
        else:
            nproc = LAYOUTS[split_variant(name)[0]][0]
            shared = sorted(set(devices) & {f"cuda:{r}" for r in range(nproc)})
            rows += [(name, nproc, dict(d, receiver_devices=devices, receiver_shares_trainer_gpu=shared))
                     for d in runs]
    dev = (f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}" if a.scale == "gpu"
           else "CPU (gloo)")
    t = Table(title=f"weight sync vs raw broadcast, {dev}, {model_desc}, {a.receivers} receiver(s)")
    for c in ("trainer layout", "procs", "senders", "bucket MiB", "buckets", "MiB", "in place %", "sync s (min)",
              "raw s (min)", "sync/raw",
              "sync/raw (median)", "sync GiB/s", "raw GiB/s", "receiver bcast GiB/s", "fill only s",
              "sync w/o fill s", "sync/raw serial"):
        t.add_column(c)
    for name, n, d in rows:
        gib = d["bytes"] / 2**30
        rb = d.get("raw_receiver_broadcast_s")
        t.add_row(name, str(n), str(d["senders"]), f"{d['bucket_mb']:g}", str(d["buckets"]),
                  f"{d['bytes'] / 2**20:.1f}",
                  f"{100 * d['inplace_bytes'] / d['bytes']:.0f}",
                  f"{d['sync_s']:.4f}", f"{d['raw_s']:.4f}", f"{d['sync_s'] / d['raw_s']:.2f}",
                  f"{d['sync_median_s'] / d['raw_median_s']:.2f}", f"{gib / d['sync_s']:.2f}",
                  f"{gib / d['raw_s']:.2f}", f"{gib / rb:.2f}" if rb else "-", f"{d['fill_only_s']:.4f}",
                  f"{d['sync_without_fill_s']:.4f}",
                  f"{d['sync_s'] / d['raw_serial_s']:.2f}" if d.get("raw_serial_s") else "-")
    Console(width=200).print(t)
    result = {"device": dev, "scale": a.scale, "model": model_desc, "receivers": a.receivers, "dtype": dtype,
              "reps": a.reps,
              "rows": [dict(layout=n, procs=k, **d) for n, k, d in rows], "failed": failed, "skipped": skipped}
    dump(result, a.json, name=f"weight_sync_{slug(dev)}_{a.scale}")
    if failed:
        raise SystemExit(f"failed: {failed}")


if __name__ == "__main__":
    main()
