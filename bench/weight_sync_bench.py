"""Weight-sync time / raw broadcast time of the same bytes over the same groups, measured in one run.

    python bench/weight_sync_bench.py                         # CPU (gloo): tiny model, receivers on CPU
    python bench/weight_sync_bench.py --scale gpu --receivers 2 --layouts tp2 ep2   # GPUs (NCCL)

Trainer ranks run mrl's real executor (TP/EP gathers, HF conversion, flattened buckets, HTTP
metadata); the receivers follow SGLang's weight-update protocol (bench/weight_receiver.py). The
raw baseline broadcasts each sender's total bytes as one buffer over the same group.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import httpx
import torch
from rich.console import Console
from rich.table import Table

HERE = os.path.dirname(os.path.abspath(__file__))
LAYOUTS = {"tp1": (1, []), "tp2": (2, ["--tp", "2"]), "ep2": (2, ["--ep", "2"]),
           "tp2ep2": (2, ["--tp", "2", "--ep", "2", "--etp", "1"]), "pp2": (2, ["--pp", "2"])}
# >= 1 GiB in bf16 (~0.84 B params): 8 layers, 64 experts of 1024x512, vocab 32768
GPU_MODEL = dict(vocab_size=32768, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
                 num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=64,
                 num_experts_per_tok=8, norm_topk_prob=True, tie_word_embeddings=False, rope_theta=1e6,
                 rms_norm_eps=1e-6, max_position_embeddings=4096)


def make_model(scale: str, root: str) -> str:
    if scale == "cpu":
        from mrl.config.schema import TinyPreset
        from mrl.models.tiny import make_tiny_model

        return make_tiny_model(os.path.join(root, "stress_a"), TinyPreset.stress_a)
    from safetensors.torch import save_file
    from transformers import Qwen3MoeConfig

    from mrl.models.qwen3_moe import Qwen3MoeBridge

    path = os.path.join(root, "gpu_moe")
    os.makedirs(path, exist_ok=True)
    cfg = Qwen3MoeConfig(architectures=["Qwen3MoeForCausalLM"], **GPU_MODEL)
    cfg.save_pretrained(path)
    shapes = Qwen3MoeBridge(cfg).hf_tensor_shapes(32768)
    g = torch.Generator().manual_seed(0)
    save_file({n: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for n, s in shapes.items()},
              os.path.join(path, "model.safetensors"))
    return path


def start_receivers(n: int, devices: list[str], root: str):
    procs, urls = [], []
    for i in range(n):
        s = __import__("socket").socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        log = open(os.path.join(root, f"receiver{i}.log"), "w")
        procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, "weight_receiver.py"), "--port", str(port),
                                       "--device", devices[i]], stdout=log, stderr=subprocess.STDOUT))
        urls.append(f"http://127.0.0.1:{port}")
    for u in urls:
        for _ in range(120):
            try:
                httpx.get(u + "/model_info", timeout=2)
                break
            except httpx.HTTPError:
                time.sleep(0.5)
    return procs, urls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument("--receivers", type=int, default=1)
    ap.add_argument("--layouts", nargs="+", default=["tp1", "tp2", "ep2", "tp2ep2", "pp2"])
    ap.add_argument("--bucket-mb", type=float, default=None)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    root = tempfile.mkdtemp(prefix="mrl_sync_bench_")
    hf = make_model(a.scale, root)
    dtype = "bf16" if a.scale == "gpu" else "fp32"
    bucket = a.bucket_mb or (256 if a.scale == "gpu" else 0.125)
    rows = []
    for name in a.layouts:
        nproc, args = LAYOUTS[name]
        devices = [f"cuda:{nproc + i}" for i in range(a.receivers)] if a.scale == "gpu" else ["cpu"] * a.receivers
        procs, urls = start_receivers(a.receivers, devices, root)
        try:
            out = os.path.join(root, f"{name}.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                   os.path.join(HERE, "_sync_worker.py"), "--hf", hf, "--dtype", dtype, "--engines",
                   ",".join(f"{u}@1" for u in urls), "--bucket-mb", str(bucket), "--reps", str(a.reps),
                   "--out", out, *args]
            r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
            if r.returncode:
                print(r.stderr[-4000:])
                raise SystemExit(f"{name} failed")
            rows.append((name, nproc, json.load(open(out))))
        finally:
            for p in procs:
                p.kill()
    dev = torch.cuda.get_device_name(0) if a.scale == "gpu" else "CPU (gloo)"
    t = Table(title=f"weight sync vs raw broadcast, {dev}, {a.receivers} receiver(s), bucket {bucket} MiB, {dtype}")
    for c in ("trainer layout", "procs", "senders", "buckets", "MiB", "sync s", "raw s", "sync/raw", "sync GiB/s"):
        t.add_column(c)
    for name, n, d in rows:
        t.add_row(name, str(n), str(d["senders"]), str(d["buckets"]), f"{d['bytes'] / 2**20:.1f}",
                  f"{d['sync_s']:.4f}", f"{d['raw_s']:.4f}", f"{d['sync_s'] / d['raw_s']:.2f}",
                  f"{d['bytes'] / 2**30 / d['sync_s']:.2f}")
    Console(width=160).print(t)
    print(json.dumps({n: d for n, _, d in rows}))


if __name__ == "__main__":
    main()
