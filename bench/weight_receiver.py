"""A weight receiver that follows SGLang 0.5.10's weight-update protocol, for benchmarks where SGLang
cannot run (the GPU machine has no SGLang) and to time raw broadcasts over the same group.

    python bench/weight_receiver.py --port 31000 [--device cuda:1]

Endpoints: /init_weights_update_group (joins the trainer's group exactly like SGLang: TCP store
client, PrefixStore(group_name), rank = rank_offset), /update_weights_from_distributed (receives the
flattened bucket or per-tensor broadcasts from rank 0; weights are received, not loaded),
/raw_receive {groups: [[group_name, nbytes], ...], measure, serial} (the benchmark's baseline: one raw
broadcast per group, launched in the listed order; ``measure``: wait for the data and return the
seconds; ``serial``: one group after the other, as an engine that blocks in each request must),
/destroy_weights_update_group, and no-op pause/continue/flush/update_weight_version/model_info.

Like SGLang 0.5.10 (``ModelRunner._update_bucketed_weights_from_distributed``: broadcast, then
load_weights, no device sync), an update answers once its broadcast is enqueued: on GPU the answer
can come before the data, and the next request's broadcast queues behind it on the group's stream.
The raw baseline answers the same way unless asked to measure. Receive buffers are kept per group
and reused (SGLang takes them from torch's caching allocator, which reuses memory the same way; on
CPU a fresh buffer would page-fault inside the timing).

Every request is logged (stdout) with its time; SIGUSR1 dumps every thread's stack (hang diagnosis).

NCCL rule kept here: all receivers must enqueue the broadcasts of different groups in one order, and
no CUDA allocation may happen while a broadcast of another group is in flight. Allocating a buffer
(cudaMalloc can wait for the device) while this process already has a broadcast of group A pending,
whose peer receiver is itself waiting on a pending broadcast of group B, deadlocks both receivers: that
was the 4-GPU hang of the raw baseline with two senders (ep2, tp2ep2) and two receivers, whose
``/raw_receive`` calls arrived concurrently and in a different order at each receiver.
"""

import argparse
import asyncio
import faulthandler
import math
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from aiohttp import web
from torch.distributed import TCPStore
from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world

DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def log(*a) -> None:
    print(f"[{time.time():.3f}]", *a, flush=True)


class Receiver:
    def __init__(self, device: str):
        self.device = torch.device(device)
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.version = "0"
        self._scratch: dict[object, torch.Tensor] = {}  # receive buffers, reused by both paths

    def _buffer(self, key, nbytes: int) -> torch.Tensor:
        """Receive buffer ``key`` (a group, or a slot of a raw request), grown when too small. Growing
        synchronizes the device first: no allocation while a broadcast is in flight (NCCL rule above);
        the receivers take requests in one order, so this waits only on broadcasts every peer has."""
        b = self._scratch.get(key)
        if b is None or b.numel() < nbytes:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            b = self._scratch[key] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return b[:nbytes]

    def _on_device(self) -> None:
        """Worker threads start on cuda:0: bind them to this receiver's GPU (no stray contexts)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def _join(self, b: dict) -> None:
        self._on_device()
        timeout = timedelta(seconds=300)
        store = TCPStore(b["master_address"], b["master_port"], b["world_size"], is_master=False, timeout=timeout)
        pg, _ = _new_process_group_helper(b["world_size"], b["rank_offset"], [], dist.Backend(b["backend"]),
                                          PrefixStore(b["group_name"], store), group_name=b["group_name"],
                                          timeout=timeout)
        _world.pg_group_ranks[pg] = {i: i for i in range(b["world_size"])}
        self.groups[b["group_name"]] = pg

    def _recv(self, group: str, nbytes: int) -> None:
        self._on_device()
        dist.broadcast(self._buffer(group, nbytes), src=0, group=self.groups[group])

    def _recv_many(self, groups: list[tuple[str, int]], measure: bool, serial: bool) -> float | None:
        """Every buffer first, then every broadcast enqueued in the given order: no allocation while a
        broadcast is pending, and the same order on every receiver. ``measure``: wait for the data."""
        self._on_device()
        bufs = [self._buffer(("raw", i), n) for i, (_, n) in enumerate(groups)]
        t0 = time.perf_counter()
        works = [dist.broadcast(b, src=0, group=self.groups[g], async_op=not serial)
                 for b, (g, _) in zip(bufs, groups)]
        works = [w for w in works if w is not None]
        for w in works:
            w.wait()
        if not measure:
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def _destroy(self, pg) -> None:
        self._on_device()
        dist.destroy_process_group(pg)

    async def init(self, req):
        b = await req.json()
        log("init", b["group_name"], "rank", b["rank_offset"], "of", b["world_size"], "port", b["master_port"])
        await asyncio.to_thread(self._join, b)
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def update(self, req):
        b = await req.json()
        sizes = [math.prod(s) * DT[d].itemsize for s, d in zip(b["shapes"], b["dtypes"])]
        log("update", b["group_name"], sum(sizes), "bytes")
        if b.get("load_format") == "flattened_bucket":
            await asyncio.to_thread(self._recv, b["group_name"], sum(sizes))
        else:
            for n in sizes:
                await asyncio.to_thread(self._recv, b["group_name"], n)
        if b.get("weight_version") is not None:
            self.version = b["weight_version"]
        return web.json_response({"success": True, "message": "Succeeded to update parameter online."})

    async def raw(self, req):
        b = await req.json()
        groups = b.get("groups") or [[b["group_name"], b["nbytes"]]]
        log("raw", groups)
        seconds = await asyncio.to_thread(self._recv_many, [(g, int(n)) for g, n in groups], b.get("measure", True),
                                          b.get("serial", False))
        return web.json_response({"success": True, "message": "received", "seconds": seconds})

    async def destroy(self, req):
        name = (await req.json())["group_name"]
        log("destroy", name)
        await asyncio.to_thread(self._destroy, self.groups.pop(name))
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})

    async def ok(self, req):
        return web.json_response({"message": "ok", "status": "ok"})

    async def flush(self, req):
        return web.Response(text="Cache flushed.\n")

    async def set_version(self, req):
        self.version = (await req.json())["new_version"]
        return web.json_response({"success": True, "message": f"Weight version updated to {self.version}"})

    async def info(self, req):
        return web.json_response({"weight_version": self.version, "model_path": "receiver"})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    log("receiver", a.device, "port", a.port)
    if a.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(a.device))
    r = Receiver(a.device)
    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/init_weights_update_group", r.init)
    app.router.add_post("/update_weights_from_distributed", r.update)
    app.router.add_post("/raw_receive", r.raw)
    app.router.add_post("/destroy_weights_update_group", r.destroy)
    app.router.add_post("/pause_generation", r.ok)
    app.router.add_post("/continue_generation", r.ok)
    app.router.add_route("*", "/flush_cache", r.flush)
    app.router.add_post("/update_weight_version", r.set_version)
    app.router.add_get("/model_info", r.info)
    web.run_app(app, host="127.0.0.1", port=a.port, print=None)


if __name__ == "__main__":
    main()
