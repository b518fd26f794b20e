"""Run the megatron paths mrl uses (build, load, SP/EP/PP fwd+bwd via the schedules, DDP,
DistributedOptimizer step) and report which CPU compat shims and megatron call sites were hit.

    torchrun --nproc-per-node 4 -m tests.jobs.compat_probe --hf DIR --tp 2 --ep 2 --etp 2 --out hits.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.distributed as dist

from mrl.megatron import compat
from mrl.megatron.optim import build_optimizer, wrap_ddp
from mrl.jobs.common import add_layout_args, load_model
from mrl.megatron.parallel import destroy
from megatron.core.pipeline_parallel import get_forward_backward_func


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    add_layout_args(ap)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)

    m = load_model(a)
    layout, bridge, cfg, model = m.layout, m.bridge, m.cfg, m.model
    ddp = wrap_ddp(model, cfg)
    opt = build_optimizer([ddp], lr=1e-3)

    b, s = 2, 16
    g = torch.Generator().manual_seed(layout.dp.rank)
    ids = torch.randint(0, bridge.vocab_size, (b, s + 1), generator=g)
    pos = torch.arange(s).unsqueeze(0).expand(b, s)

    def forward_step(data_iterator, m):
        out = m(input_ids=ids[:, :-1], position_ids=pos, attention_mask=None, labels=ids[:, 1:])

        def loss_func(per_token_loss):
            loss = per_token_loss.float().mean()
            return loss, {"loss": loss.detach()}

        return out, loss_func

    for _ in range(2):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([None, None]), model=[ddp],
                                    num_microbatches=2, seq_length=s, micro_batch_size=b, forward_only=False)
        ok, grad_norm, _ = opt.step()
        assert ok, "optimizer step skipped"

    hits = {n: sorted(sh.hits) for n, sh in compat.SHIMS.items()}
    objs = [None] * layout.world_size
    dist.all_gather_object(objs, hits)
    if layout.world_rank == 0:
        merged: dict[str, set] = {}
        for o in objs:
            for n, sites in o.items():
                merged.setdefault(n, set()).update(sites)
        applied = {n: sh.applied for n, sh in compat.SHIMS.items()}
        with open(a.out, "w") as f:
            json.dump({"applied": applied, "hits": {n: sorted(v) for n, v in merged.items()},
                       "grad_norm": float(grad_norm)}, f, indent=1)
    destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
