"""Keep Routing check: replay engine-recorded experts in any layout, and report what the routers did.

    torchrun --nproc-per-node 2 -m tests.jobs.replay_check --hf DIR --tp 2 --input samples.json \\
        --micro-batches 2 --recompute --pack-len 32 --out DIR
    torchrun ... --layouts tp2:tp=2,recompute=1 pp2:pp=2,pp_first=2 --out DIR   # in turn, DIR/<name>/

``samples.json``: ``{"sequences": [[ids]], "routes": [[[[expert]*K]*L]*(n-1)]}`` (engine records, dense
layers dropped). One training forward/backward with replay (``--micro-batches`` through megatron's
schedule, optional full activation recompute), then a natural (RECORD) pass, and with ``--pack-len``
the replayed training pass again on packed rows (each micro-batch's samples first-fit into rows of
that many tokens, block-diagonal causal mask). Each rank writes ``rank<r>.json``: the experts its
routers actually dispatched to (from the routing map, forward and recompute calls separately) with
the token coordinates they belong to (packed: where each sample sits), and on the last stage the
per-sample logprobs of every pass.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

from mrl.jobs.common import add_layout_args, load_model
from mrl.megatron import compat
from mrl.megatron.packing import Packing, first_fit_decreasing
from mrl.megatron.parallel import destroy
from mrl.megatron.train_step import MicroBatch, forward_backward
from mrl.models import get_bridge
from mrl.routing.codec import RoutesCodec
from mrl.routing.replay import RankSlice, ReplayDriver, ReplayMode, align_routes, stage_moe_columns
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
from tests.jobs.parity import parse_layout


def _router_taps(model):
    """Forward hooks on every local router: the expert ids of each call's routing map."""
    calls: list[tuple[int, bool, torch.Tensor]] = []
    m = model
    routers = [layer.mlp.router for layer in m.decoder.layers if hasattr(layer.mlp, "router")]
    for j, r in enumerate(routers):
        def hook(mod, _inp, out, j=j):
            routing_map = out[1]
            k = int(routing_map.sum(1).max())
            ids = routing_map.float().topk(k, dim=1).indices.sort(1).values  # expert set per token
            recompute = mod.router_replay is not None and \
                mod.router_replay.router_replay_action == RouterReplayAction.REPLAY_BACKWARD
            calls.append((j, recompute, ids.detach().cpu()))
        r.register_forward_hook(hook)
    return calls


def _packed_micro_batches(mbs, seqs, mine, per_mb, row_len, codec):
    """Each micro-batch's samples first-fit into rows of ``row_len`` (as many rows in every micro-batch),
    routes packed the same way; returns them and, per micro-batch, ``[sample, row, offset]`` of each."""
    groups = []
    for j in range(len(mbs)):
        idx = mine[j * per_mb:(j + 1) * per_mb]
        groups.append((j, idx, first_fit_decreasing([len(seqs[i]) for i in idx], row_len)))
    rows = max(len(bins) for _, _, bins in groups)
    out, where = [], []
    for j, idx, bins in groups:
        pk = Packing.build([len(seqs[i]) for i in idx], bins, row_len=row_len, num_rows=rows, fmt="mask",
                           device=compat.DEVICE)
        width = pk.width
        fill = torch.arange(codec.top_k, device=compat.DEVICE) % codec.num_experts
        out.append(MicroBatch(pk.pack_tokens(mbs[j].input_ids[:, :width], 0),
                              pk.pack_tokens(mbs[j].routes[:, :width], fill), packing=pk))
        where.append([[i, pk.row[b], pk.offset[b]] for b, i in enumerate(idx)])
    return out, where


# -- reading the records (bench/gpu_loop.py) ---------------------------------------------------------
def agreement(samples_json: dict, reps: list[dict], key: str) -> tuple[int, int]:
    """(agreeing, total) (token, MoE layer) decisions: the routers' expert sets (``key``: "forward_calls"
    with replay, "natural_calls" without) vs the engine's, over every rank's records (not packed). A
    router call's token i is (s, b) = (i // rows, i % rows) of its micro-batch, s counted from the rank's
    own slice of the sequence under sequence parallelism; without it the TP ranks of one DP rank see
    the same tokens, so only TP rank 0 counts."""
    agree = total = 0
    for rep in reps:
        if not rep["sp"] and rep["tp_rank"] != 0:
            continue
        s0 = rep["tp_rank"] * rep["seq_len"] // rep["tp"] if rep["sp"] else 0
        ncol, rows = len(rep["moe_columns"]), rep["per_mb"]
        for n, (col, ids) in enumerate(rep[key]):
            mb = n // ncol
            for i, got in enumerate(ids):
                s, b = divmod(i, rows)
                seq = rep["sequences"][mb * rows + b]
                routes = samples_json["routes"][seq]
                if s0 + s < len(samples_json["sequences"][seq]) - 1:
                    total += 1
                    agree += sorted(got) == sorted(routes[s0 + s][rep["moe_columns"][col]])
    return agree, total


def logprob_diffs(samples_json: dict, reps: list[dict], key: str) -> dict:
    """|trainer - engine| logprob over the response tokens of every sequence, from the ranks that hold
    logprobs (the last pipeline stage, TP rank 0 of each DP rank)."""
    vals, seen = [], set()
    for rep in reps:
        if rep["tp_rank"] != 0 or not rep[key]:
            continue
        for mb, lps in enumerate(rep[key]):
            for b, lp in enumerate(lps):
                i = rep["sequences"][mb * rep["per_mb"] + b]
                seen.add(i)
                p, eng = samples_json["prompt_lens"][i], np.asarray(samples_json["engine_logprobs"][i])
                vals.append(np.abs(np.asarray(lp)[p - 1:p - 1 + len(eng)] - eng))
    if len(seen) != len(samples_json["sequences"]):
        raise RuntimeError(f"logprobs of {len(seen)} of {len(samples_json['sequences'])} sequences in the records")
    allv = np.concatenate(vals)
    return {"mean_abs": float(allv.mean()), "p99_abs": float(np.quantile(allv, 0.99)), "max_abs": float(allv.max())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    add_layout_args(ap)
    ap.add_argument("--input", required=True)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--recompute", action="store_true")
    ap.add_argument("--pack-len", type=int, default=None, help="also run the replayed pass packed, rows of N tokens")
    ap.add_argument("--layouts", nargs="+", default=None,
                    help="NAME:tp=2,ep=2,...[,recompute=1] each (tests.jobs.parity), one after the other in these "
                         "processes; reports in OUT/NAME/")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if not a.layouts:
        check(a, a, a.out)
    for item in a.layouts or []:
        name, _, text = item.partition(":")
        kv = dict(x.split("=") for x in text.split(","))
        la = parse_layout(",".join(f"{k}={v}" for k, v in kv.items() if k != "recompute"), a.hf)
        la.recompute = kv.get("recompute") == "1"
        check(la, a, os.path.join(a.out, name))
        RouterReplay.clear_global_router_replay_instances()
    destroy()
    return 0


def check(la: argparse.Namespace, a: argparse.Namespace, out: str) -> None:
    """One layout ``la`` (model and layout flags); the input and passes of ``a``; ``out/rank<r>.json``."""
    over = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) \
        if la.recompute else {}
    m = load_model(la, **over)
    layout, bridge, model = m.layout, m.bridge, m.model
    pcfg = layout.config
    with open(a.input) as f:
        data = json.load(f)
    seqs = data["sequences"]
    codec = RoutesCodec.from_bridge(get_bridge(a.hf))
    # one padded length for all; a multiple of tp (sequence parallelism splits S)
    seq_len = max(len(s) for s in seqs)
    seq_len += (-seq_len) % pcfg.tp
    dp, dp_rank = layout.dp.size, layout.dp.rank
    per_mb = len(seqs) // (dp * a.micro_batches)
    if per_mb * dp * a.micro_batches != len(seqs):
        raise ValueError(f"{len(seqs)} sequences do not split into dp={dp} x {a.micro_batches} micro-batches")
    mine = list(range(dp_rank * per_mb * a.micro_batches, (dp_rank + 1) * per_mb * a.micro_batches))
    ids = torch.tensor([seqs[i] + [0] * (seq_len - len(seqs[i])) for i in mine], device=compat.DEVICE)
    routes = torch.from_numpy(np.stack([align_routes(np.asarray(data["routes"][i]), seq_len, codec.num_experts)
                                        for i in mine])).to(compat.DEVICE)
    mbs = [MicroBatch(ids[j * per_mb:(j + 1) * per_mb], routes[j * per_mb:(j + 1) * per_mb])
           for j in range(a.micro_batches)]
    stage_layers = pcfg.stage_layers(bridge.num_layers)
    rs = RankSlice(tp_rank=layout.tp.rank, tp_size=layout.tp.size, sequence_parallel=m.cfg.sequence_parallel,
                   moe_columns=stage_moe_columns(codec.moe_layers, stage_layers, layout.pp.rank))
    calls = _router_taps(model)

    def loss_fn(lp, mb):  # any differentiable loss: the check is about routing, not the objective
        return -lp.mean(), {}

    model.train()
    replayed = forward_backward(model, layout, mbs, vocab_size=bridge.vocab_size, loss_fn=loss_fn,
                                driver=ReplayDriver(m.cfg, rs, ReplayMode.replay))
    replay_calls = list(calls)
    calls.clear()
    model.eval()
    natural = forward_backward(model, layout, mbs, vocab_size=bridge.vocab_size, forward_only=True,
                               driver=ReplayDriver(m.cfg, rs, ReplayMode.record))
    natural_calls = list(calls)
    packed = {}
    if a.pack_len:
        calls.clear()
        pmbs, layout_rows = _packed_micro_batches(mbs, seqs, mine, per_mb, a.pack_len, codec)
        model.train()
        outs = forward_backward(model, layout, pmbs, vocab_size=bridge.vocab_size, loss_fn=loss_fn,
                                driver=ReplayDriver(m.cfg, rs, ReplayMode.replay))
        packed = {"packed_rows": layout_rows, "packed_row_len": a.pack_len,
                  "packed_num_rows": pmbs[0].packing.num_rows,
                  "packed_forward_calls": [(j, c.tolist()) for j, r, c in calls if not r],
                  "packed_recompute_calls": [(j, c.tolist()) for j, r, c in calls if r],
                  "logprobs_packed": [o["logprobs"].tolist() for o in outs]}
    fwd = [(j, c.tolist()) for j, rec, c in replay_calls if not rec]
    rec = [(j, c.tolist()) for j, rec, c in replay_calls if rec]
    report = {
        "rank": layout.world_rank, "dp_rank": dp_rank, "tp_rank": layout.tp.rank, "pp_rank": layout.pp.rank,
        "sequences": mine, "per_mb": per_mb, "seq_len": seq_len, "moe_columns": list(rs.moe_columns),
        "tp": layout.tp.size, "sp": bool(m.cfg.sequence_parallel),
        "forward_calls": fwd, "recompute_calls": rec,
        "natural_calls": [(j, c.tolist()) for j, _, c in natural_calls],
        "logprobs_replay": [o["logprobs"].tolist() for o in replayed],
        "logprobs_natural": [o["logprobs"].tolist() for o in natural],
        **packed,
    }
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank{layout.world_rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    sys.exit(main())
