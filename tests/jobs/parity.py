"""Parity of checkpoints in several layouts, in one torchrun launch (every family's check).

    torchrun --nproc-per-node 2 -m tests.jobs.parity --out report.json \\
        --case DIR_A "tp=1" "tp=2" "ep=2" "tp=2,ep=2,etp=1" "pp=2,pp_first=2" --case DIR_B "tp=2" "pp=2"

transformers runs once per process (fp32, eager) and gives the reference logits and, from each MoE
layer's own ``route_tokens_to_experts``, the experts every token is routed to. Then for each layout the
megatron model is built and loaded through mrl's loader, run forward with megatron's RouterReplay in
RECORD mode, and compared on every rank: logits (last stage), the experts each local router chose
against transformers' choice for the same tokens (as sets, in the router's token order: s-first, the
sequence-parallel chunk, this stage's MoE layers), and the HF export against the input checkpoint.
Building each layout in the same processes keeps the cost to one start-up for all layouts.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.distributed as dist

from mrl.jobs.common import load_model
from mrl.megatron.forward import forward_logits, token_logprobs
from mrl.megatron.parallel import destroy
from mrl.megatron.weights import export_hf
from mrl.routing.codec import RoutesCodec
from mrl.routing.replay import RankSlice, stage_moe_columns
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction


def hf_reference(path: str, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [B, S, V] and routed experts [B, S, moe_layers, K] of transformers' model."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    routes: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(hf.model.layers):
        moe = layer.mlp
        if hasattr(moe, "route_tokens_to_experts"):  # GLM-4.5, DeepSeek-V3: the gate gives logits
            def hook(mod, _inp, logits, moe=moe, i=i):
                routes[i] = moe.route_tokens_to_experts(logits)[0]
            moe.gate.register_forward_hook(hook)
        elif hasattr(moe, "experts") and hasattr(moe, "gate"):  # Qwen3-MoE: the gate gives (logits, scores, experts)
            def hook(mod, _inp, out, i=i):
                routes[i] = out[2]
            moe.gate.register_forward_hook(hook)
    with torch.no_grad():
        logits = hf(input_ids=ids).logits.float()
    b, s = ids.shape
    return logits, torch.stack([routes[i].view(b, s, -1) for i in sorted(routes)], 2)


def parse_layout(text: str, hf: str) -> argparse.Namespace:
    kv = dict(item.split("=") for item in text.split(","))
    return argparse.Namespace(hf=hf, tp=int(kv.get("tp", 1)), pp=int(kv.get("pp", 1)), ep=int(kv.get("ep", 1)),
                              etp=int(kv["etp"]) if "etp" in kv else None,
                              pp_first=int(kv["pp_first"]) if "pp_first" in kv else None, pp_last=None,
                              dispatcher=kv.get("dispatcher", "alltoall"), dtype="fp32")


def check_layout(a: argparse.Namespace, ids: torch.Tensor, ref_logits: torch.Tensor, ref_routes: torch.Tensor,
                 want: dict[str, torch.Tensor]) -> dict:
    m = load_model(a)
    layout, bridge, model = m.layout, m.bridge, m.model.eval()
    codec = RoutesCodec.from_bridge(bridge)
    cols = stage_moe_columns(codec.moe_layers, layout.config.stage_layers(bridge.num_layers), layout.pp.rank)
    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
    logits = forward_logits(model, layout, ids)
    recorded = RouterReplay.get_recorded_data()
    RouterReplay.clear_global_router_replay_action()
    rs = RankSlice(tp_rank=layout.tp.rank, tp_size=layout.tp.size, sequence_parallel=m.cfg.sequence_parallel,
                   moe_columns=cols)
    expected = rs.tokens(ref_routes)  # [S_local * B, L_local, K]
    mine = {"routed_tokens": 0, "routing_mismatches": 0}
    for j, got in enumerate(recorded):
        same = (got.sort(-1).values == expected[:, j].sort(-1).values).all(-1)
        mine["routed_tokens"] += same.numel()
        mine["routing_mismatches"] += int((~same).sum())
    if logits is not None:
        v = bridge.vocab_size
        mine["logits_max_abs_diff"] = (logits[..., :v].float() - ref_logits).abs().max().item()
        mine["logprobs_max_abs_diff"] = (token_logprobs(logits, ids, v) - token_logprobs(ref_logits, ids, v)
                                         ).abs().max().item()
    exported = export_hf(model, layout, bridge, m.padded_vocab)
    if exported is not None:
        mine["roundtrip_tensors"] = len(exported)
        mine["roundtrip_bit_exact"] = set(exported) == set(want) and all(
            torch.equal(exported[k], want[k]) for k in want)
    everyone = [None] * layout.world_size
    dist.all_gather_object(everyone, mine)
    out = {"layout": vars(a), "routed_tokens": sum(r["routed_tokens"] for r in everyone),
           "routing_mismatches": sum(r["routing_mismatches"] for r in everyone),
           "moe_layers_per_rank": [len(cols)]}
    for r in everyone:
        for k in ("logits_max_abs_diff", "logprobs_max_abs_diff"):
            if k in r:
                out[k] = max(out.get(k, 0.0), r[k])
        for k in ("roundtrip_tensors", "roundtrip_bit_exact"):
            if k in r:
                out[k] = r[k]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", nargs="+", action="append", required=True, metavar="HF LAYOUT",
                    help="a checkpoint and its layouts; repeat it for several checkpoints in one launch")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if any(len(c) < 2 for c in a.case):
        ap.error("--case DIR LAYOUT ...: each checkpoint with one layout at least")
    results = []
    for hf, *layouts in a.case:
        results += check_checkpoint(hf, layouts, a.batch, a.seq)
    if dist.get_rank() == 0:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
        print(json.dumps(results, indent=1), flush=True)
    destroy()
    return 0


def check_checkpoint(path: str, layouts: list[str], batch: int, seq: int) -> list[dict]:
    """Each layout's report (``name``: the layout, ``hf``: the checkpoint) against transformers' model."""
    from mrl.models import get_bridge
    from mrl.models.checkpoint import HFCheckpoint

    bridge = get_bridge(path)
    ids = torch.randint(0, bridge.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    ref_logits, ref_routes = hf_reference(path, ids)
    ckpt = HFCheckpoint(path)
    want = {k: ckpt.read(k) for k in ckpt.shapes}
    results = []
    for text in layouts:
        res = check_layout(parse_layout(text, path), ids, ref_logits, ref_routes, want)
        res |= {"name": text, "hf": path}
        results.append(res)
        RouterReplay.clear_global_router_replay_instances()
    return results


if __name__ == "__main__":
    sys.exit(main())
