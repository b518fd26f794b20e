"""torchrun worker of bench/lora_sync.py: full-weight syncs and adapter syncs into the same live engine.

    torchrun --nproc-per-node 1 bench/_lora_sync_worker.py --hf DIR --engine URL --ranks 8 64 --reps 5 \\
        --export-dir DIR --out result.json

Full weights: mrl's ``FullWeightChannel`` (pause, flush, push, stamp, continue) over the distributed transport
(gloo on CPU) and over the disk transport, the trainer's params in megatron's DDP buffer as in training.
Adapters: ``AdapterSync`` from tensors (HTTP, plain pickle) and from disk (a PEFT directory), one new
version per repetition, the previous version unloaded after it (what the rollout side's router does once
it is idle; timed on its own). Every kind is followed by one request on the new weights (first use).
Repetitions interleave the kinds after one warm-up of each.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch.distributed as dist

from mrl.config.schema import WeightTransport
from mrl.jobs.common import add_layout_args, load_model
from mrl.megatron.optim import wrap_ddp
from mrl.megatron.parallel import destroy
from _bench_common import engine_call
from mrl.config.lora_engine import ATTENTION, LoraEngineSpec
from mrl.sglang.wire import adapter_name
from mrl.sglang.protocol import EngineHTTPError
from mrl.weight_sync.adapter import AdapterSync, random_adapter
from mrl.weight_sync.factory import make_transport
from mrl.weight_sync.full import FullWeightChannel
from mrl.sglang.endpoint import EngineEndpoint

PROMPT = [1, 17, 42, 99, 7, 300, 5, 11, 12, 13, 250, 251, 64, 3, 77, 401] * 4




def first_use(url: str, lora: str | None) -> float:
    """One request of one new token on the new weights: prefill from scratch (a full sync flushes the cache;
    a new adapter version has a radix cache of its own)."""
    t = time.perf_counter()
    engine_call(url, lambda c: c.generate(PROMPT, {"max_new_tokens": 1, "temperature": 0.0},
                                          rid=f"first-{time.time_ns()}", lora_path=lora))
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser()
    add_layout_args(ap)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--alpha", type=float, default=16.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--export-dir", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    m = load_model(a)
    layout, bridge = m.layout, m.bridge
    model = wrap_ddp(m.model, m.cfg)
    engines = [EngineEndpoint(a.engine, 1)]
    syncers = {}
    for kind in (WeightTransport.distributed, WeightTransport.disk):
        transport, disk = make_transport(kind, model=model, layout=layout, bridge=bridge, padded_vocab=m.padded_vocab,
                                         engines=engines, bucket_bytes=512 << 20,
                                         export_dir=os.path.join(a.export_dir, f"full_{kind.value}"), config_src=a.hf)
        syncers[f"full_{kind.value}"] = FullWeightChannel(transport, disk, layout, engines)
        syncers[f"full_{kind.value}"].connect()
    with open(os.path.join(a.hf, "config.json")) as f:
        hf_config = json.load(f)
    spec = LoraEngineSpec(max_rank=max(a.ranks), targets=ATTENTION)
    adapters = {r: random_adapter(hf_config, targets=ATTENTION, r=r, alpha=a.alpha, seed=r) for r in a.ranks}
    pushers = {f"adapter_r{r}_{mode}": (AdapterSync([a.engine], spec=spec, timeout_s=300,
                                                    export_dir=os.path.join(a.export_dir, f"r{r}") if mode == "disk"
                                                    else None), adapters[r])
               for r in a.ranks for mode in ("tensors", "disk")}
    version = iter(range(1, 10_000))
    rows: dict[str, list[dict]] = {k: [] for k in [*syncers, *pushers]}

    def full(kind: str) -> dict:
        v = next(version)
        dist.barrier()
        t = time.perf_counter()
        rep = syncers[kind].sync(str(v))
        dist.barrier()
        return {"seconds": time.perf_counter() - t, "push_seconds": rep.push_seconds, "bytes": rep.bytes_sent,
                "engine_paused": True, "first_use_s": first_use(a.engine, None)}

    def adapter(kind: str) -> dict:
        sync, (tensors, config) = pushers[kind]
        v = next(version)
        prev = sync.current
        rep = sync.push(tensors, config, v)
        row = {"seconds": rep.seconds, "engine_load_s": rep.engine_seconds[a.engine], "bytes": rep.tensor_bytes,
               "wire_bytes": rep.payload_bytes, "engine_paused": False,
               "first_use_s": first_use(a.engine, adapter_name(v))}
        if prev is not None:
            t = time.perf_counter()
            try:
                engine_call(a.engine, lambda c: c.unload_lora_adapter(prev[0]))
                row["unload_previous_s"] = time.perf_counter() - t
            except EngineHTTPError as e:  # warm-up: another pusher's first contact unloaded it already
                if "does not exist" not in str(e):
                    raise
        return row

    kinds = [*syncers, *pushers]
    if layout.world_rank == 0:
        print(f"[lora_sync] warm-up of {kinds}", flush=True)
    for _ in range(2):  # warm-up: first broadcast on a group; a pusher's first contact clears the others'
        for k in kinds:
            full(k) if k in syncers else adapter(k)
    for i in range(a.reps):
        for k in kinds:
            rows[k].append(full(k) if k in syncers else adapter(k))
        if layout.world_rank == 0:
            print(f"[lora_sync] rep {i + 1}/{a.reps}: " + ", ".join(f"{k} {rows[k][-1]['seconds'] * 1e3:.1f} ms"
                                                                    for k in kinds), flush=True)
    for s in syncers.values():
        s.close()
    if layout.world_rank == 0:
        with open(a.out, "w") as f:
            json.dump({"reps": rows, "full_weight_bytes": rows["full_distributed"][0]["bytes"]}, f, indent=1)
    destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
