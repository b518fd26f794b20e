"""Worker of bench/full_depth.py: synthetic weights into an engine started without any (``load_format=dummy``).

    python bench/_full_depth_push.py --hf DIR --seed 0 --url URL --tp 1 --transport tensor --out push.json

Each HF tensor is drawn (``mrl.models.synthetic``, on the GPU where there is one: the trainer draws the same
there) and pushed bucket by bucket through ``mrl.weight_sync.named`` (CUDA IPC handles, or a safetensors
file per bucket on CPU), then the weight version; this process holds one bucket, and exits before the
trainer needs the GPU. Then the check: SGLang's own hash of the engine's tensors of the first and the last
layer (experts included), the embeddings, the final norm and the head, rank by rank, against the same
tensors drawn again and cut as the engine holds them (``bench/_live_sync_worker._bitwise``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import torch

from mrl.models.synthetic import SyntheticWeights
from mrl.sglang.client import ClientTimeouts
from mrl.sglang.endpoint import EngineEndpoint
from mrl.weight_sync.named import push_named


def sampled(weights: SyntheticWeights) -> dict[str, torch.Tensor]:
    """The full tensors the bitwise check compares: layer 0, the last layer, and everything outside layers."""
    last = weights.bridge.num_layers - 1
    out = {}
    for name in weights.shapes:
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m is None or int(m.group(1)) in (0, last):
            out[name] = weights.full(name).clone()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--url", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--transport", default="tensor", choices=["tensor", "disk"])
    ap.add_argument("--bucket-mb", type=float, default=1024)
    ap.add_argument("--export-dir", default=None, help="disk: where each bucket's file goes (read by the engine)")
    ap.add_argument("--version", default="1")
    ap.add_argument("--engine-device", default="cuda", help="where the engine's ranks hold their weights")
    ap.add_argument("--no-verify", action="store_true")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    weights = SyntheticWeights(a.hf, seed=a.seed, device=device, cache_bytes=0)
    ep = EngineEndpoint(a.url, a.tp)
    stats = push_named([ep], weights.tensors(), version=a.version, transport=a.transport, bucket_mb=a.bucket_mb,
                       export_dir=a.export_dir, timeouts=ClientTimeouts(weight_update=1800.0))
    rep = {"seconds": stats.seconds, "bytes": stats.bytes_sent, "buckets": stats.buckets, "tensors": stats.tensors,
           "gb_per_s": stats.bytes_sent / stats.seconds / 1e9, "transport": a.transport, "bucket_mb": a.bucket_mb,
           "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None}
    if stats.bytes_sent != weights.num_bytes:  # every tensor of the model, each once
        raise SystemExit(f"pushed {stats.bytes_sent} bytes, the model has {weights.num_bytes}")
    print(f"[full_depth] pushed {stats.bytes_sent / 1e9:.2f} GB in {stats.buckets} buckets, {stats.seconds:.1f} s",
          flush=True)
    if not a.no_verify:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from _live_sync_worker import _bitwise

        # a CPU engine serves in fp32 (the bf16 values widened), a GPU one in the weights' bf16
        dtype = torch.float32 if a.engine_device == "cpu" else weights.dtype
        rep["bitwise"] = _bitwise(a.url, sampled(weights), weights.bridge, dtype, [a.engine_device] * a.tp, a.tp)
        print(f"[full_depth] bitwise: {rep['bitwise'].get('equal')}/{rep['bitwise'].get('compared')} equal",
              flush=True)
    with open(a.out, "w") as f:
        json.dump(rep, f, indent=1)
    return 0 if rep.get("bitwise", {"all_equal": True}).get("all_equal") else 1


if __name__ == "__main__":
    sys.exit(main())
