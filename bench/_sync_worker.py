"""torchrun worker of bench/weight_sync_bench.py: time a full weight sync vs a raw broadcast of the
same bytes over the same weight-update groups, into receiver processes."""

import argparse
import asyncio
import faulthandler
import json
import os
import statistics
import threading

import httpx
import torch
import torch.distributed as dist

from mrl.jobs.common import add_layout_args, load_model
from mrl.megatron import compat
from mrl.megatron.optim import wrap_ddp
from mrl.megatron.parallel import destroy
from mrl.weight_sync.copy_plan import BucketStep
from mrl.weight_sync.executor import BucketExecutor
from mrl.jobs.sync_weights import parse_engines
from _bench_common import timed

ap = argparse.ArgumentParser()
add_layout_args(ap)
ap.add_argument("--engines", required=True)
ap.add_argument("--bucket-mb", type=float, nargs="+", default=[512], help="one sync set-up per size, in turn")
ap.add_argument("--reps", type=int, default=3)
ap.add_argument("--out", required=True)
a = ap.parse_args()
# MRL_BENCH_NO_DDP=1 (a layout variant, tp1+MRL_BENCH_NO_DDP=1): the params as loaded, not in megatron's DDP
# parameter buffer as the trainer holds them, so no bucket is contiguous in memory and all are copied
no_ddp = os.environ.get("MRL_BENCH_NO_DDP") == "1"
if os.environ.get("MRL_DUMP_AFTER"):  # diagnosing hangs: every thread's stack, then exit
    faulthandler.dump_traceback_later(int(os.environ["MRL_DUMP_AFTER"]), exit=True)

m = load_model(a)
layout = m.layout
engines = parse_engines(a.engines)
model = m.model if no_ddp else wrap_ddp(m.model, m.cfg)  # the trainer's DDP + distributed-optimizer buffer

class _Poster:
    """Rank 0's persistent HTTP client on its own loop (no per-call client or thread set-up in the timing)."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.client = asyncio.run_coroutine_threadsafe(self._make(), self.loop).result()

    async def _make(self):
        return httpx.AsyncClient(timeout=600)

    def post_all(self, path, body):
        async def go():
            rs = await asyncio.gather(*(self.client.post(e.url + path, json=body) for e in engines))
            for r in rs:
                r.raise_for_status()
            return [r.json() for r in rs]

        return asyncio.run_coroutine_threadsafe(go(), self.loop)


poster = _Poster() if layout.world_rank == 0 else None


def bench(bucket_mb: float) -> dict:
    sync = BucketExecutor(model=model, layout=layout, bridge=m.bridge, padded_vocab=m.padded_vocab,
                          engines=engines, bucket_bytes=int(bucket_mb * (1 << 20)),
                          dtype="bfloat16" if a.dtype == "bf16" else "float32",
                          group_prefix=f"mrl-b{bucket_mb:g}".replace(".", "_"))
    sync.connect()
    my_bytes = sum(b.nbytes for b in sync.plan.for_sender(layout.world_rank))
    # every sender's total, in the plan's sender order (= the receivers' group order)
    all_bytes = [None] * layout.world_size
    dist.all_gather_object(all_bytes, my_bytes if sync.is_sender else None)
    raw_groups = [[g, all_bytes[r]] for r, g in sorted(sync.plan.groups.items())]
    buf = torch.empty(my_bytes, dtype=torch.uint8, device=compat.DEVICE) if sync.is_sender else None
    recv_s: list[float] = []

    def raw(measure: bool = False, serial: bool = False) -> None:
        """The baseline: each sender broadcasts all its bytes as one buffer over its own group; one
        request per receiver, posted by rank 0 (as the sync's controller), lists the groups in the plan's
        order, so every receiver enqueues them in the same order (per-sender requests raced: NCCL hang).
        Receivers answer as soon as their broadcasts are enqueued, as in the sync (SGLang's way);
        ``measure``: they wait for the data and report how long the broadcasts took. ``serial``: they
        receive one group after the other (gloo: what an engine that blocks in each request can do)."""
        body = {"groups": raw_groups, "measure": measure, "serial": serial}
        fut = poster.post_all("/raw_receive", body) if poster else None
        if sync.is_sender:
            dist.broadcast(buf, src=0, group=sync._pg)
        if fut is not None:
            answers = fut.result(600)
            if measure:
                recv_s.append(max(r["seconds"] for r in answers))

    def push() -> None:
        st = sync.push()
        if not st.ok:
            raise RuntimeError(f"weight sync failed: {st.failed_engines}")

    # interleaved after one warm-up of each (communicator set-up, receiver buffers)
    timed(push)
    timed(raw)
    sync_s, raw_s = [], []
    for _ in range(a.reps):
        sync_s.append(timed(push))
        raw_s.append(timed(raw))
    for _ in range(3):  # the receivers' own broadcast time (not part of either timing)
        timed(lambda: raw(measure=True))
    # several senders on gloo: the raw bytes with the groups received one after the other
    serial_s = ([timed(lambda: raw(serial=True)) for _ in range(a.reps)]
                if len(raw_groups) > 1 and not compat.HAS_CUDA else None)
    # where the time goes: the copy plan alone (gathers + copies, no broadcast), and the sync without it
    # (broadcasts and per-bucket requests of whatever the send buffers hold)
    fill_s = min(timed(lambda: [st.fill() for st in sync.steps()]) for _ in range(3))
    fill = BucketStep.fill
    BucketStep.fill = lambda self: None
    try:
        nofill_s = min(timed(push) for _ in range(3))
    finally:
        BucketStep.fill = fill
    out = {"bucket_mb": bucket_mb, "bytes": sync.plan.nbytes, "sync_s": min(sync_s), "raw_s": min(raw_s),
           "fill_only_s": fill_s, "sync_without_fill_s": nofill_s,
           "sync_median_s": statistics.median(sync_s), "raw_median_s": statistics.median(raw_s),
           "raw_receiver_broadcast_s": min(recv_s) if recv_s else None,
           "raw_serial_s": min(serial_s) if serial_s else None,
           "senders": len(sync.plan.groups), "buckets": len(sync.plan.buckets),
           "inplace_bytes": sum(b.nbytes for b in sync.plan.buckets if b.inplace),
           "all_sync_s": sync_s, "all_raw_s": raw_s}
    buf = None  # free it before the next bucket size (raw() reads it through the closure)
    sync.close()
    return out


results = [bench(mb) for mb in a.bucket_mb]
if layout.world_rank == 0:
    json.dump({"runs": results}, open(a.out, "w"))
destroy()
