"""torchrun worker of bench/replay_overhead.py: megatron forward+backward through
``mrl.megatron.train_step.forward_backward`` with Keep Routing replay on (a ReplayDriver in
ReplayMode.replay fed with routes) vs off (driver=None), same model/layout/batch, interleaved.

``--compare packing``: replay on in both modes; "off" = one right-padded sample per row, "on" = the
same long-tailed samples packed (first-fit decreasing rows of ``--seq`` tokens, block-diagonal mask),
as many micro-batches each."""

import argparse
import json
import math
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

from _bench_common import record_routes, spread
from mrl.jobs.common import add_layout_args, load_model
from mrl.megatron import compat
from mrl.megatron.packing import first_fit_decreasing, pack_micro_batches
from mrl.megatron.parallel import destroy
from mrl.megatron.train_step import MicroBatch, forward_backward
from mrl.routing.codec import RoutesCodec
from mrl.routing.replay import RankSlice, ReplayDriver, ReplayMode, align_routes, stage_moe_columns

ap = argparse.ArgumentParser()
add_layout_args(ap)
ap.add_argument("--batch", type=int, default=2, help="sequences per micro-batch (per DP rank)")
ap.add_argument("--seq", type=int, default=128)
ap.add_argument("--micro-batches", type=int, default=2)
ap.add_argument("--reps", type=int, default=10)
ap.add_argument("--warmup", type=int, default=2)
ap.add_argument("--profile", action="store_true", help="also profile one step of each mode (torch.profiler)")
ap.add_argument("--compare", choices=["replay", "packing"], default="replay")
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


def long_tailed_lengths(n: int) -> list[int]:
    """Pareto-tailed lengths in [8, seq], the longest exactly seq: most samples short, a few long."""
    x = (np.random.default_rng(int(g.initial_seed())).pareto(1.5, n) + 1.0) * a.seq / 8
    lengths = np.clip(x, 8, a.seq).astype(int)
    lengths[int(np.argmax(lengths))] = a.seq
    return lengths.tolist()


def make_packing_pair() -> dict[str, list[MicroBatch]]:
    """One long-tailed batch as "off" (padded rows) and "on" (packed rows), same samples and routes."""
    n = a.micro_batches * a.batch
    lengths = long_tailed_lengths(n)
    ids = torch.zeros(n, a.seq, dtype=torch.long)
    mask = torch.zeros(n, a.seq - 1)
    routes = []
    for i, m_ in enumerate(lengths):
        ids[i, :m_] = torch.randint(1, bridge.vocab_size, (m_,), generator=g)
        mask[i, m_ // 2:m_ - 1] = 1.0
        r = torch.stack([torch.stack([torch.randperm(codec.num_experts, generator=g)[:codec.top_k]
                                      for _ in codec.moe_layers]) for _ in range(m_ - 1)])
        routes.append(align_routes(r.numpy(), a.seq, codec.num_experts))
    routes = torch.from_numpy(np.stack(routes))
    dev = compat.DEVICE
    off = [MicroBatch(ids[j:j + a.batch].to(dev), routes[j:j + a.batch].to(dev), {"mask": mask[j:j + a.batch].to(dev)})
           for j in range(0, n, a.batch)]
    rows = len(first_fit_decreasing(lengths, a.seq))
    on = []
    fill = torch.arange(codec.top_k) % codec.num_experts
    for idx, pk in pack_micro_batches(lengths, dp_size=1, dp_rank=0, row_len=a.seq, device=dev,
                                      rows_per_micro_batch=math.ceil(rows / a.micro_batches)):
        w = pk.width
        on.append(MicroBatch(pk.pack_tokens(ids[idx, :w], 0).to(dev), pk.pack_tokens(routes[idx, :w], fill).to(dev),
                             {"mask": mask[idx, :w - 1].to(dev)}, packing=pk))
        on[-1].data["order"] = torch.tensor(idx)
    stats["padded_tokens"], stats["packed_tokens"] = n * a.seq, sum(mb.input_ids.numel() for mb in on)
    stats["real_tokens"], stats["rows_packed"] = sum(lengths), sum(mb.input_ids.shape[0] for mb in on)
    return {"off": off, "on": on}


stats: dict[str, float] = {}
if a.compare == "packing":
    batches = [make_packing_pair() for _ in range(a.warmup + a.reps)]
    ntok = sum(float(mb.data["mask"].sum()) for mb in batches[0]["off"])
else:
    batches = [make_batch() for _ in range(a.warmup + a.reps)]
driver = ReplayDriver(cfg, rs, ReplayMode.replay)


def loss_fn(lp, mb):
    return -(lp * mb.data["mask"]).sum() / ntok, {}


def sync():
    if compat.HAS_CUDA:
        torch.cuda.synchronize()


cpu_s = {"off": [], "on": []}


def step(on: bool, mbs) -> tuple[float, list]:
    mode = "on" if on else "off"
    if isinstance(mbs, dict):  # packing comparison: replay in both modes, padded vs packed rows
        mbs, on = mbs[mode], True
    model.zero_grad(set_to_none=True)
    dist.barrier()
    sync()
    t0, c0 = time.perf_counter(), time.process_time()
    outs = forward_backward(model, layout, mbs, vocab_size=bridge.vocab_size, loss_fn=loss_fn,
                            driver=driver if on else None)
    sync()
    cpu_s[mode].append(time.process_time() - c0)
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

# checks: natural routes replayed -> same logprobs; shifted routes -> different logprobs (replay is live);
# packing: every sample's packed logprobs equal its padded-row ones
check = {}
if a.compare == "packing":
    if last["on"]:
        pair = batches[a.warmup + a.reps - 1]
        off_lp = torch.cat([o["logprobs"] for o in last["off"]])
        diffs = []
        for o, mb in zip(last["on"], pair["on"]):
            for row, i, n_ in zip(o["logprobs"], mb.data["order"].tolist(), mb.packing.length):
                diffs.append(float((row[:n_ - 1] - off_lp[i, :n_ - 1]).abs().max()))
        check["max_abs_logprob_diff_packed_vs_padded"] = max(diffs)
elif last["on"]:
    check["max_abs_logprob_diff_replay_vs_natural"] = max(
        float((x["logprobs"] - y["logprobs"]).abs().max()) for x, y in zip(last["on"], last["off"]))
if a.compare == "replay":
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
    # each repetition runs both modes back to back (order flipped every repetition): its ratio pairs
    # steps that shared the host's state, which the ratio of the two medians does not
    paired = spread([n / f for n, f in zip(times["on"], times["off"])])
    dp = layout.dp.size
    json.dump({"off_s": times["off"], "on_s": times["on"], "off_median_s": med["off"], "on_median_s": med["on"],
               "off_min_s": min(times["off"]), "on_min_s": min(times["on"]),
               "ratio_median": med["on"] / med["off"], "ratio_min": min(times["on"]) / min(times["off"]),
               "ratio_paired_median": paired["median"], "ratio_paired_p25_p75": [paired["p25"], paired["p75"]],
               "tokens_per_step": a.micro_batches * a.batch * a.seq * dp, "dp": dp,
               "moe_layers_local": len(rs.moe_columns),
               "cpu_s_median": {k: statistics.median(v) for k, v in cpu_s.items()},
               "profiles": profiles, **stats, **merged}, open(a.out, "w"))
destroy()
