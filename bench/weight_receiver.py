"""A weight receiver that follows SGLang 0.5.10's weight-update protocol, for benchmarks where SGLang
cannot run (the GPU machine has no SGLang) and to time raw broadcasts over the same group.

    python bench/weight_receiver.py --port 31000 [--device cuda:1]

Endpoints: /init_weights_update_group (joins the trainer's group exactly like SGLang: TCP store
client, PrefixStore(group_name), rank = rank_offset), /update_weights_from_distributed (receives the
flattened bucket or per-tensor broadcasts from rank 0; weights are received, not loaded),
/raw_receive {group_name, nbytes} (one raw broadcast, the benchmark's baseline),
/destroy_weights_update_group, and no-op pause/continue/flush/update_weight_version/model_info.
"""

import argparse
import asyncio
from datetime import timedelta

import torch
import torch.distributed as dist
from aiohttp import web
from torch.distributed import TCPStore
from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world

DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Receiver:
    def __init__(self, device: str):
        self.device = torch.device(device)
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.version = "0"

    def _join(self, b: dict) -> None:
        timeout = timedelta(seconds=300)
        store = TCPStore(b["master_address"], b["master_port"], b["world_size"], is_master=False, timeout=timeout)
        pg, _ = _new_process_group_helper(b["world_size"], b["rank_offset"], [], dist.Backend(b["backend"]),
                                          PrefixStore(b["group_name"], store), group_name=b["group_name"],
                                          timeout=timeout)
        _world.pg_group_ranks[pg] = {i: i for i in range(b["world_size"])}
        self.groups[b["group_name"]] = pg

    def _recv(self, group: str, nbytes: int) -> None:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        dist.broadcast(buf, src=0, group=self.groups[group])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    async def init(self, req):
        b = await req.json()
        await asyncio.to_thread(self._join, b)
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def update(self, req):
        b = await req.json()
        sizes = [torch.empty(s, dtype=DT[d], device="meta").numel() * DT[d].itemsize
                 for s, d in zip(b["shapes"], b["dtypes"])]
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
        await asyncio.to_thread(self._recv, b["group_name"], int(b["nbytes"]))
        return web.json_response({"success": True, "message": "received"})

    async def destroy(self, req):
        name = (await req.json())["group_name"]
        await asyncio.to_thread(dist.destroy_process_group, self.groups.pop(name))
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
