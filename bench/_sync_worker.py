"""torchrun worker of bench/weight_sync_bench.py: time a full weight sync vs a raw broadcast of the
same bytes over the same weight-update groups, into receiver processes."""

import argparse
import faulthandler
import os
import asyncio
import concurrent.futures
import json
import time

import httpx
import torch
import torch.distributed as dist

from mrl.jobs.common import add_layout_args, load_model
from mrl.megatron import compat
from mrl.megatron.parallel import destroy
from mrl.weight_sync.executor import DistributedWeightSync
from mrl.jobs.sync_weights import parse_engines

ap = argparse.ArgumentParser()
add_layout_args(ap)
ap.add_argument("--engines", required=True)
ap.add_argument("--bucket-mb", type=float, default=512)
ap.add_argument("--reps", type=int, default=3)
ap.add_argument("--out", required=True)
a = ap.parse_args()
if os.environ.get("MRL_DUMP_AFTER"):  # diagnosing hangs: every thread's stack, then exit
    faulthandler.dump_traceback_later(int(os.environ["MRL_DUMP_AFTER"]), exit=True)

m = load_model(a)
layout = m.layout
engines = parse_engines(a.engines)
sync = DistributedWeightSync(model=m.model, layout=layout, bridge=m.bridge, padded_vocab=m.padded_vocab,
                             engines=engines, bucket_bytes=int(a.bucket_mb * (1 << 20)),
                             dtype="bfloat16" if a.dtype == "bf16" else "float32")
sync.connect()


def timed(fn) -> float:
    dist.barrier()
    if compat.HAS_CUDA:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if compat.HAS_CUDA:
        torch.cuda.synchronize()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=compat.DEVICE)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the sync is done when the slowest sender is done
    return t.item()


my_bytes = sum(b.nbytes for b in sync.plan.for_sender(layout.world_rank))


def raw() -> None:
    if not sync.is_sender:
        return
    buf = torch.empty(my_bytes, dtype=torch.uint8, device=compat.DEVICE)
    # the receivers serve raw requests concurrently, so each sender posts its own
    with concurrent.futures.ThreadPoolExecutor(len(engines)) as ex:
        futs = [ex.submit(asyncio.run, _post(e.url, sync.group_name, my_bytes)) for e in engines]
        dist.broadcast(buf, src=0, group=sync._pg)
        for f in futs:
            f.result(600)


async def _post(url, group, nbytes):
    async with httpx.AsyncClient(timeout=600) as c:
        r = await c.post(url + "/raw_receive", json={"group_name": group, "nbytes": nbytes})
        r.raise_for_status()


sync_s = [timed(sync.push) for _ in range(a.reps)]
raw_s = [timed(raw) for _ in range(a.reps)]
total = sync.plan.nbytes
if layout.world_rank == 0:
    json.dump({"bytes": total, "sync_s": min(sync_s), "raw_s": min(raw_s), "senders": len(sync.plan.groups),
               "buckets": len(sync.plan.buckets), "all_sync_s": sync_s, "all_raw_s": raw_s}, open(a.out, "w"))
sync.close()
destroy()
