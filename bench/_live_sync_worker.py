"""torchrun worker of bench/gpu_loop.py: weight syncs into a live SGLang engine vs a raw broadcast.

    torchrun --nproc-per-node 1 bench/_live_sync_worker.py --hf DIR --dtype bf16 --engine URL@TP \\
        --engine-device cuda:1 --reps 5 --out sync.json

The trainer side is mrl's real one: megatron model (any layout), params in megatron's DDP buffer as in
training, ``EngineSync`` (pause, flush, streamed buckets over NCCL/gloo, version stamp, continue). The
raw baseline broadcasts the same number of bytes as one buffer from trainer rank 0 to a plain torch
process on the engine's device (``--engine-device``), over a group built the same way; sync and raw
repetitions alternate after one warm-up of each. After the syncs: the engine's teacher-forced logprobs
of a probe against the trainer's, and a bitwise check of sampled tensors read back from the engine
(``/get_weights_by_name``, where the engine serves it).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from mrl.config.schema import WeightTransport
from mrl.jobs.common import add_layout_args, load_model
from mrl.megatron import compat
from mrl.megatron.forward import forward_logits, token_logprobs
from mrl.megatron.optim import wrap_ddp
from mrl.megatron.parallel import destroy
from mrl.megatron.weights import export_hf
from _bench_common import engine_call
from mrl.rollout.engine import free_port
from mrl.weight_sync.group import create_sender_group, destroy_sender_group
from mrl.weight_sync.sync import EngineSync, make_transport
from mrl.weight_sync.transport import EngineEndpoint

HERE = os.path.dirname(os.path.abspath(__file__))

RECEIVER = r"""
import sys, time, torch, torch.distributed as dist
from datetime import timedelta
from torch.distributed import TCPStore
from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world
addr, name, device = sys.argv[1], sys.argv[3], sys.argv[6]
port, nbytes, reps, rank, world = (int(sys.argv[i]) for i in (2, 4, 5, 7, 8))
backend = "nccl" if device.startswith("cuda") else "gloo"
if backend == "nccl":
    torch.cuda.set_device(torch.device(device))
store = PrefixStore(name, TCPStore(addr, port, world, is_master=False, timeout=timedelta(seconds=300)))
pg, _ = _new_process_group_helper(world, rank, [], dist.Backend(backend), store, group_name=name,
                                  timeout=timedelta(seconds=300))
_world.pg_group_ranks[pg] = {i: i for i in range(world)}
buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
for _ in range(reps):
    dist.broadcast(buf, src=0, group=pg)
    if backend == "nccl":
        torch.cuda.synchronize()
print("raw receiver done", flush=True)
"""




def _probe_logprobs(url: str, probe: list[int]) -> list[float]:
    async def fn(c):
        out = await c.generate(probe, {"max_new_tokens": 1, "temperature": 0.0}, rid=f"probe-{time.time_ns()}",
                               logprob_start_len=0)
        return out.input_logprobs[1:]
    return engine_call(url, fn)


def _checksums(url: str) -> list[dict[str, str]]:
    async def fn(c):
        return await c.weight_checksums()
    return engine_call(url, fn)


# Engine params that are HF tensors unchanged (no fusion, no TP split at engine TP1): their hashes must
# equal the hashes of the trainer's export, byte for byte.
UNFUSED = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", "model.layers.0.input_layernorm.weight",
           "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.gate.weight"]


def main() -> int:
    ap = argparse.ArgumentParser()
    add_layout_args(ap)
    ap.add_argument("--engine", required=True, help="url@tp")
    ap.add_argument("--engine-device", required=True,
                    help="the engine's devices (comma-separated, one per engine TP rank), for the raw receivers")
    ap.add_argument("--bucket-mb", type=float, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--compare-per-bucket", action="store_true",
                    help="each repetition also syncs with one update request per bucket (the engine takes a "
                         "sync's buckets in one request otherwise)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    m = load_model(a)
    layout, bridge = m.layout, m.bridge
    model = wrap_ddp(m.model, m.cfg)  # params live in megatron's DDP buffer, as in training
    url, _, tp = a.engine.partition("@")
    engines = [EngineEndpoint(url, int(tp or 1))]
    sync_dtype = {"bf16": "bfloat16", "fp32": "float32"}[a.dtype]
    transport, disk = make_transport(WeightTransport.distributed, model=model, layout=layout, bridge=bridge,
                                     padded_vocab=m.padded_vocab, engines=engines,
                                     bucket_bytes=int(a.bucket_mb * (1 << 20)), export_dir=None, config_src=a.hf,
                                     dtype=sync_dtype)
    syncer = EngineSync(transport, disk, layout, engines)
    syncer.connect()
    nbytes = transport.executor.plan.nbytes
    rank0 = layout.world_rank == 0

    raw_pg = receivers = None
    if rank0:
        port = free_port()
        name = f"raw-{os.getpid()}"
        # one receiver per engine rank: the bytes every engine GPU receives in a sync
        devices = a.engine_device.split(",")
        receivers = [subprocess.Popen([sys.executable, "-c", RECEIVER, "127.0.0.1", str(port), name, str(nbytes),
                                       str(a.reps + 1), d, str(i + 1), str(len(devices) + 1)])
                     for i, d in enumerate(devices)]
        raw_pg = create_sender_group(master_address="127.0.0.1", master_port=port, world_size=len(devices) + 1,
                                     group_name=name, backend=compat.BACKEND)
        raw_buf = torch.empty(nbytes, dtype=torch.uint8, device=compat.DEVICE)

    def raw() -> float:
        dist.barrier()
        t = time.perf_counter()
        if rank0:
            dist.broadcast(raw_buf, src=0, group=raw_pg)
            if compat.HAS_CUDA:
                torch.cuda.synchronize()
        dist.barrier()
        return time.perf_counter() - t

    batched: list[str] = []
    phases: list[dict[str, float]] = []  # the sequence's phases (EngineSync), per batched sync

    def sync(v: int, per_bucket: bool = False) -> tuple[float, float]:
        transport.executor.batch_requests = not per_bucket
        dist.barrier()
        t = time.perf_counter()
        rep = syncer.sync(str(v))
        dist.barrier()
        if not per_bucket:
            batched[:] = rep.stamped_with_push
            phases.append(rep.phase_seconds)
        return time.perf_counter() - t, rep.push_seconds

    sync(1), raw()  # warm-up: the first NCCL broadcast on a group builds its communicator
    if a.compare_per_bucket:
        sync(1, per_bucket=True)
    phases.clear()
    sync_s, push_s, raw_s, pb_sync_s, pb_push_s = [], [], [], [], []
    for v in range(2, a.reps + 2):
        if a.compare_per_bucket:  # alternating: one request per bucket, all buckets in one, raw
            s, p = sync(v, per_bucket=True)
            pb_sync_s.append(s)
            pb_push_s.append(p)
        s, p = sync(v)
        sync_s.append(s)
        push_s.append(p)
        raw_s.append(raw())
    if rank0:
        for r in receivers:
            r.wait(timeout=120)
        destroy_sender_group(raw_pg)

    # the engine follows the trainer: teacher-forced probe logprobs, and sampled tensors read back
    probe = torch.randint(3, bridge.vocab_size, (1, 64), generator=torch.Generator().manual_seed(7))
    logits = forward_logits(model.eval(), layout, probe.to(compat.DEVICE))
    mine = None
    if logits is not None:  # the last pipeline stage
        mine = token_logprobs(logits, probe.to(compat.DEVICE), bridge.vocab_size)[0].tolist()
    box = [None] * layout.world_size
    dist.all_gather_object(box, mine)
    mine = next(x for x in box if x is not None)
    hf = export_hf(model, layout, bridge, m.padded_vocab) or {}
    syncer.close()
    if rank0:
        engine_lp = _probe_logprobs(url, probe[0].tolist())
        bitwise: dict = {}
        try:
            from sglang.srt.managers.mm_utils import tensor_hash  # the engine's own hash function

            engine_sums = _checksums(url)[0]
        except Exception as e:  # e.g. SGLang's CPU mode cannot hash (its checker synchronises CUDA)
            engine_sums, bitwise = None, {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        dev = a.engine_device.split(",")[0]
        dev = dev if dev.startswith("cuda") else "cpu"  # the engine hashes on its device
        for n in UNFUSED if engine_sums is not None else []:
            if n not in engine_sums or n not in hf:
                bitwise[n] = "absent"
                continue
            mine_t = hf[n].to(getattr(torch, sync_dtype)).to(dev).contiguous()
            bitwise[n] = f"{tensor_hash(mine_t):016x}" == engine_sums[n]
        ratio = [s / r for s, r in zip(sync_s, raw_s)]
        report = {
            "bytes": nbytes, "sync_dtype": sync_dtype, "buckets": len(transport.executor.plan.buckets),
            "sync_s": sync_s, "push_s": push_s, "raw_s": raw_s, "sync_vs_raw_per_rep": ratio,
            "sync_median_s": statistics.median(sync_s), "raw_median_s": statistics.median(raw_s),
            "sync_vs_raw": statistics.median(sync_s) / statistics.median(raw_s),
            "push_vs_raw": statistics.median(push_s) / statistics.median(raw_s),
            "engine_tp": int(tp or 1), "trainer_ranks": layout.world_size,
            "sync_gb_per_s": nbytes / statistics.median(sync_s) / 1e9,
            "probe_max_abs_logprob_diff": max(abs(x - y) for x, y in zip(engine_lp, mine)),
            "probe_mean_abs_logprob_diff": sum(abs(x - y) for x, y in zip(engine_lp, mine)) / len(mine),
            "bitwise_sampled_tensors": bitwise,
            "host": socket.gethostname(),
            "batched_request_engines": batched,
            "sync_phases_s": phases,
            "sync_phases_median_s": {k: statistics.median(p[k] for p in phases) for k in phases[0]} if phases else {},
        }
        if pb_sync_s:
            report |= {"per_bucket_sync_s": pb_sync_s, "per_bucket_push_s": pb_push_s,
                       "per_bucket_sync_vs_raw": statistics.median(pb_sync_s) / statistics.median(raw_s),
                       "per_bucket_push_vs_raw": statistics.median(pb_push_s) / statistics.median(raw_s),
                       "batched_vs_per_bucket_per_rep": [b / p for b, p in zip(sync_s, pb_sync_s)]}
        print(json.dumps({k: v for k, v in report.items() if not isinstance(v, list)}), flush=True)
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
