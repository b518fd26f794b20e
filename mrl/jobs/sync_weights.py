"""Push a Megatron model (any layout) into running SGLang engines and verify them.

    torchrun --nproc-per-node 2 -m mrl.jobs.sync_weights --hf DIR --tp 2 --engines http://127.0.0.1:30000@1 \\
        --version 1 --out report.json

Sequence (rank 0 is the controller): pause(abort) + flush every engine -> every sender streams its
buckets -> engines that rejected a bucket or lost the broadcast are reloaded through the disk path
(safetensors export + update_weights_from_disk) -> stamp ``weight_version`` -> continue. Then verify: engine logprobs of a probe sequence
(teacher-forced, ``logprob_start_len=0``) against Megatron's, and the version each engine reports.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile

import torch
import torch.distributed as dist

from mrl.megatron import compat
from mrl.megatron.forward import forward_logits, token_logprobs
from mrl.jobs.common import add_layout_args, load_model
from mrl.megatron.parallel import destroy
from mrl.rollout.client import EngineClient
from mrl.megatron.weights import export_hf
from mrl.models.checkpoint import save_hf
from mrl.weight_sync.executor import DistributedWeightSync, EngineEndpoint, SyncFault


def parse_engines(s: str) -> list[EngineEndpoint]:
    out = []
    for item in s.split(","):
        url, _, tp = item.partition("@")
        out.append(EngineEndpoint(url, int(tp or 1)))
    return out


async def _controller(engines, fn):
    clients = [EngineClient(e.url) for e in engines]
    try:
        return await asyncio.gather(*(fn(c) for c in clients))
    finally:
        for c in clients:
            await c.close()


async def _pause(c):
    await c.pause("abort")
    await c.flush_cache()


async def _finish(c, version):
    await c.update_weight_version(version, abort_all_requests=False)
    await c.resume()


async def _probe_engine(c, probe, tag):
    """Teacher-forced logprobs of ``probe`` (logprob_start_len=0) and the engine's weight version."""
    out = await c.generate(probe[0].tolist(), {"max_new_tokens": 1, "temperature": 0.0},
                           rid=f"probe-{tag}-{id(c)}", logprob_start_len=0)
    return out.input_logprobs[1:], await c.weight_version()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    add_layout_args(ap)
    ap.add_argument("--engines", required=True, help="url@tp,url@tp")
    ap.add_argument("--version", required=True)
    ap.add_argument("--bucket-mb", type=float, default=0.25)
    ap.add_argument("--repair-dir", default=None, help="where the disk-path repair writes the checkpoint")
    ap.add_argument("--fault-bucket", type=int, default=None, help="tests: send this bucket one row short")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)

    m = load_model(a)
    layout, bridge, vp, model = m.layout, m.bridge, m.padded_vocab, m.model.eval()
    pcfg = layout.config
    engines = parse_engines(a.engines)

    probe = torch.randint(0, bridge.vocab_size, (1, 48), generator=torch.Generator().manual_seed(7))
    probe[0, 0] = 1
    before = asyncio.run(_controller(engines, lambda c: _probe_engine(c, probe, "before"))) \
        if layout.world_rank == 0 else None
    fault = SyncFault(a.fault_bucket) if a.fault_bucket is not None else None
    sync = DistributedWeightSync(model=model, layout=layout, bridge=bridge, padded_vocab=vp, engines=engines,
                                 bucket_bytes=int(a.bucket_mb * (1 << 20)), fault=fault)
    sync.connect()
    if layout.world_rank == 0:
        asyncio.run(_controller(engines, _pause))
    dist.barrier()
    stats = sync.push()
    repaired: list[str] = []
    if not stats.ok:  # never leave an engine on partial weights: reload it through the disk path
        exported = export_hf(model, layout, bridge, vp)  # collective: every rank takes part
        if layout.world_rank == 0:
            path = a.repair_dir or tempfile.mkdtemp(prefix=f"mrl_repair_v{a.version}_")
            save_hf(exported, path, config_src=a.hf)
            bad = [e for e in engines if e.url in stats.failed_engines]
            asyncio.run(_controller(bad, lambda c: c.update_weights_from_disk(path, weight_version=a.version)))
            repaired = [e.url for e in bad]
    if layout.world_rank == 0:
        asyncio.run(_controller(engines, lambda c: _finish(c, a.version)))
    sync.close()

    # verify: teacher-forced logprobs of a probe sequence, engine vs this trainer
    logits = forward_logits(model, layout, probe.to(compat.DEVICE))
    mine = token_logprobs(logits, probe, bridge.vocab_size)[0].tolist() if logits is not None else None
    box = [None] * layout.world_size
    dist.all_gather_object(box, mine)
    mine = next(x for x in box if x is not None)
    if layout.world_rank == 0:
        res = asyncio.run(_controller(engines, lambda c: _probe_engine(c, probe, "after")))
        diffs = [max(abs(x - y) for x, y in zip(lps, mine)) for lps, _ in res]
        diffs_before = [max(abs(x - y) for x, y in zip(lps, mine)) for lps, _ in before]
        report = {"layout": f"tp{a.tp}_pp{a.pp}_ep{a.ep}_etp{pcfg.expert_tp}", "engines": a.engines,
                  "probe_max_abs_logprob_diff": diffs,
                  "probe_max_abs_logprob_diff_before": diffs_before, "engine_versions": [v for _, v in res],
                  "push_seconds": stats.seconds, "bytes": stats.bytes_sent, "buckets_rank0": stats.buckets_sent,
                  "senders": len(sync.plan.groups), "buckets_total": len(sync.plan.buckets),
                  "failed_engines": stats.failed_engines, "repaired_from_disk": repaired}
        print(json.dumps(report), flush=True)
        with open(a.out, "w") as f:
            json.dump(report, f)
    destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
