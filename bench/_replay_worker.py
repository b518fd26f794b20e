"""torchrun worker of bench/replay_overhead.py: megatron forward+backward through
``mrl.megatron.train_step.forward_backward`` with Keep Routing replay on (a ReplayDriver in
ReplayMode.replay fed with routes) vs off (driver=None), same model/layout/batch, interleaved."""

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from _bench_common import record_routes
from mrl.jobs.common import add_layout_args, load_model
from mrl.megatron import compat
from mrl.megatron.parallel import destroy
from mrl.megatron.train_step import MicroBatch, forward_backward
from mrl.routing.codec import RoutesCodec
from mrl.routing.replay import RankSlice, ReplayDriver, ReplayMode, stage_moe_columns

ap = argparse.ArgumentParser()
add_layout_args(ap)
ap.add_argument("--batch", type=int, default=2, help="sequences per micro-batch (per DP rank)")
ap.add_argument("--seq", type=int, default=128)
ap.add_argument("--micro-batches", type=int, default=2)
ap.add_argument("--reps", type=int, default=10)
ap.add_argument("--warmup", type=int, default=2)
ap.add_argument("--profile", action="store_true", help="also profile one step of each mode (torch.profiler)")
ap.add_argument("--out", required=True)
a = ap.parse_args()

m = load_model(a)
layout, bridge, model, cfg = m.layout, m.bridge, m.model, m.cfg
model.train()
codec = RoutesCodec.from_bridge(bridge)
rs = RankSlice(tp_rank=layout.tp.rank, tp_size=layout.tp.size, sequence_parallel=cfg.sequence_parallel,
               moe_columns=stage_moe_columns(codec.moe_layers, layout.config.stage_layers(bridge.num_layers),
                                             layout.pp.rank))
g = torch.Generator().manual_seed(1000 + layout.dp.rank)  # each DP rank its own data
ntok = a.micro_batches * a.batch * (a.seq - 1)


def make_batch() -> list[MicroBatch]:
    """Fresh token ids and their natural routes (recorded once). Every timed step gets its own batch,
    the same one in both modes: replaying one fixed batch would repeat the exact per-expert GEMM shapes
    (cuBLAS heuristics cached) while natural routing drifts by a few bf16 near-ties, an artefact that
    made replay look 10-15% faster than no replay on GPU."""
    mbs = [MicroBatch(torch.randint(0, bridge.vocab_size, (a.batch, a.seq), generator=g).to(compat.DEVICE),
                      data={"mask": torch.ones(a.batch, a.seq - 1, device=compat.DEVICE)})
           for _ in range(a.micro_batches)]
    routes = record_routes(model, layout, rs, cfg, mbs, vocab_size=bridge.vocab_size,
                           num_layers=len(codec.moe_layers), top_k=codec.top_k, num_experts=codec.num_experts)
    for mb, r in zip(mbs, routes):
        mb.routes = r
    return mbs


batches = [make_batch() for _ in range(a.warmup + a.reps)]
driver = ReplayDriver(cfg, rs, ReplayMode.replay)


def loss_fn(lp, mb):
    return -(lp * mb.data["mask"]).sum() / ntok, {}


def sync():
    if compat.HAS_CUDA:
        torch.cuda.synchronize()


cpu_s = {"off": [], "on": []}


def step(on: bool, mbs: list[MicroBatch]) -> tuple[float, list]:
    model.zero_grad(set_to_none=True)
    dist.barrier()
    sync()
    t0, c0 = time.perf_counter(), time.process_time()
    outs = forward_backward(model, layout, mbs, vocab_size=bridge.vocab_size, loss_fn=loss_fn,
                            driver=driver if on else None)
    sync()
    cpu_s["on" if on else "off"].append(time.process_time() - c0)
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=compat.DEVICE)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item(), outs


for w in range(a.warmup):
    step(False, batches[w])
    step(True, batches[w])
times = {"off": [], "on": []}
last = {}
for r in range(a.reps):
    for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
        t, outs = step(mode == "on", batches[a.warmup + r])
        times[mode].append(t)
        last[mode] = outs

profiles = {}
if a.profile:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if compat.HAS_CUDA else [])
    for mode in ("off", "on"):
        with profile(activities=acts) as prof:
            t, _ = step(mode == "on", batches[-1])
        ev = prof.key_averages()
        dev_us = sum(getattr(e, "self_device_time_total", 0) for e in ev)
        profiles[mode] = {"wall_s": t, "device_busy_s": dev_us / 1e6,
                          "top_cpu": ev.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60),
                          "top_device": ev.table(sort_by="self_device_time_total", row_limit=12,
                                                 max_name_column_width=60) if compat.HAS_CUDA else ""}

# checks: natural routes replayed -> same logprobs; shifted routes -> different logprobs (replay is live)
check = {}
if last["on"]:
    check["max_abs_logprob_diff_replay_vs_natural"] = max(
        float((x["logprobs"] - y["logprobs"]).abs().max()) for x, y in zip(last["on"], last["off"]))
shifted = [MicroBatch(mb.input_ids, (mb.routes + 1) % codec.num_experts, mb.data) for mb in batches[-1]]
_, outs = step(True, shifted)
if outs:
    check["max_abs_logprob_diff_shifted_routes"] = max(
        float((x["logprobs"] - y["logprobs"]).abs().max()) for x, y in zip(outs, last["off"]))
box = [None] * layout.world_size
dist.all_gather_object(box, check)
if layout.world_rank == 0:
    merged = {k: max(c[k] for c in box if k in c) for k in sorted({k for c in box for k in c})}
    med = {k: statistics.median(v) for k, v in times.items()}
    dp = layout.dp.size
    json.dump({"off_s": times["off"], "on_s": times["on"], "off_median_s": med["off"], "on_median_s": med["on"],
               "off_min_s": min(times["off"]), "on_min_s": min(times["on"]),
               "ratio_median": med["on"] / med["off"], "ratio_min": min(times["on"]) / min(times["off"]),
               "tokens_per_step": a.micro_batches * a.batch * a.seq * dp, "dp": dp,
               "moe_layers_local": len(rs.moe_columns), "cpu_s_median": {k: statistics.median(v) for k, v in cpu_s.items()},
               "profiles": profiles, **merged}, open(a.out, "w"))
destroy()
