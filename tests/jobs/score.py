"""Trainer-side scoring: per-token logprobs and the experts megatron's router picks, for given sequences.

    torchrun --nproc-per-node 2 -m tests.jobs.score --hf DIR --tp 2 --input seqs.json --out scores.json

``seqs.json``: ``{"sequences": [[token ids], ...]}``. Output per sequence: ``logprobs`` (log p of
token t given tokens < t, for t >= 1, over the real vocabulary) and ``routes`` (``[T, moe_layers, K]``
expert ids from RouterReplay RECORD, natural routing; PP=1 only). Used to check engine outputs
against the trainer (tests/integration) and, later, by the trainer's logprob recompute.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.distributed as dist

from mrl.megatron import compat
from mrl.megatron.forward import forward_logits, token_logprobs
from mrl.jobs.common import add_layout_args, load_model
from mrl.megatron.parallel import destroy
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    add_layout_args(ap)
    ap.add_argument("--input", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)

    m = load_model(a)
    layout, bridge, cfg, model = m.layout, m.bridge, m.cfg, m.model.eval()
    pcfg = layout.config
    with open(a.input) as f:
        seqs = json.load(f)["sequences"]

    results = []
    for seq in seqs:
        n = len(seq)
        pad = (-n) % pcfg.tp  # SP splits the sequence over TP; right padding leaves causal outputs unchanged
        ids = torch.tensor([seq + [0] * pad], device=compat.DEVICE)
        RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
        logits = forward_logits(model, layout, ids)
        recorded = RouterReplay.get_recorded_data()  # per MoE layer [T_local, K], token index = s (b=1)
        RouterReplay.clear_global_router_replay_action()
        RouterReplay.clear_global_indices()
        routes = None
        if pcfg.pp == 1:
            if cfg.sequence_parallel:  # each TP rank routed its own sequence chunk
                gathered = []
                for t in recorded:
                    parts = [torch.empty_like(t) for _ in range(layout.tp.size)]
                    dist.all_gather(parts, t.contiguous(), group=layout.tp.group)
                    gathered.append(torch.cat(parts, 0))
                recorded = gathered
            routes = torch.stack([t[:n] for t in recorded], 1).tolist()
        item = {"routes": routes}
        if logits is not None:
            item["logprobs"] = token_logprobs(logits[:, :n], ids[:, :n], bridge.vocab_size)[0].tolist()
        results.append(item)
    if layout.world_rank == 0:
        with open(a.out, "w") as f:
            json.dump({"results": results}, f)
    destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
