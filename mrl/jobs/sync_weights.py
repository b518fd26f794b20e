"""Push a Megatron model (any layout) into running SGLang engines and verify them.

    torchrun --nproc-per-node 2 -m mrl.jobs.sync_weights --hf DIR --tp 2 --engines http://127.0.0.1:30000@1 \\
        --version 1 --out report.json

Sequence (rank 0 is the controller): pause every engine (``--pause-mode``; abort: + flush) -> every sender streams its
buckets -> engines that rejected a bucket or lost the broadcast are reloaded through the disk path
(safetensors export + update_weights_from_disk) -> stamp ``weight_version`` -> continue. Then verify:
engine logprobs of a probe sequence (teacher-forced, ``logprob_start_len=0``) against Megatron's, and the
version each engine reports.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import torch
import torch.distributed as dist

from mrl.megatron import compat
from mrl.megatron.forward import forward_logits, token_logprobs
from mrl.jobs.common import add_layout_args, load_model
from mrl.megatron.parallel import destroy
from mrl.config.schema import WeightTransport
from mrl.sglang.client import EngineClient
from mrl.weight_sync.factory import make_transport
from mrl.weight_sync.full import SYNC_MODES, FullWeightChannel
from mrl.sglang.endpoint import EngineEndpoint


def parse_engines(s: str) -> list[EngineEndpoint]:
    out = []
    for item in s.split(","):
        url, _, tp = item.partition("@")
        out.append(EngineEndpoint(url, int(tp or 1)))
    return out


async def _controller(engines, fn):
    clients = [EngineClient(e) for e in engines]
    try:
        return await asyncio.gather(*(fn(c) for c in clients))
    finally:
        for c in clients:
            await c.close()


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
    ap.add_argument("--transport", default="distributed", choices=[t.value for t in WeightTransport])
    ap.add_argument("--repair-dir", default=None, help="where the disk-path repair writes the checkpoint")
    ap.add_argument("--pause-mode", default="abort", choices=list(SYNC_MODES),
                    help="how the engines pause (weight_sync.pause_mode): retract / in_place keep their requests, "
                    "staged does not pause them")
    ap.add_argument("--no-probe-before", action="store_true",
                    help="skip the probe before the sync (engines the caller holds paused answer none)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeat", type=int, default=1,
                    help="syncs in a row (the last one stamps --version, those before --version-<i>)")
    a = ap.parse_args(argv)

    m = load_model(a)
    layout, bridge, vp, model = m.layout, m.bridge, m.padded_vocab, m.model.eval()
    pcfg = layout.config
    engines = parse_engines(a.engines)

    probe = torch.randint(0, bridge.vocab_size, (1, 48), generator=torch.Generator().manual_seed(7))
    probe[0, 0] = 1
    before = asyncio.run(_controller(engines, lambda c: _probe_engine(c, probe, "before"))) \
        if layout.world_rank == 0 and not a.no_probe_before else None
    transport, disk = make_transport(WeightTransport(a.transport), model=model, layout=layout, bridge=bridge,
                                     padded_vocab=vp, engines=engines, bucket_bytes=int(a.bucket_mb * (1 << 20)),
                                     export_dir=a.repair_dir, config_src=a.hf)
    syncer = FullWeightChannel(transport, disk, layout, engines, pause_mode=a.pause_mode)
    syncer.connect()
    for i in range(a.repeat):
        rep = syncer.sync(a.version if i == a.repeat - 1 else f"{a.version}-{i}")
    syncer.close()
    ex = getattr(transport, "executor", None)

    # verify: teacher-forced logprobs of a probe sequence, engine vs this trainer
    logits = forward_logits(model, layout, probe.to(compat.DEVICE))
    mine = token_logprobs(logits, probe, bridge.vocab_size)[0].tolist() if logits is not None else None
    box = [None] * layout.world_size
    dist.all_gather_object(box, mine)
    mine = next(x for x in box if x is not None)
    if layout.world_rank == 0:
        res = asyncio.run(_controller(engines, lambda c: _probe_engine(c, probe, "after")))
        diffs = [max(abs(x - y) for x, y in zip(lps, mine)) for lps, _ in res]
        diffs_before = [max(abs(x - y) for x, y in zip(lps, mine)) for lps, _ in before] if before else None
        report = {"layout": f"tp{a.tp}_pp{a.pp}_ep{a.ep}_etp{pcfg.expert_tp}", "engines": a.engines,
                  "transport": rep.transport, "pause_mode": a.pause_mode, "phase_seconds": rep.phase_seconds,
                  "probe_max_abs_logprob_diff": diffs,
                  "probe_max_abs_logprob_diff_before": diffs_before, "engine_versions": [v for _, v in res],
                  "sync_seconds": rep.seconds, "push_seconds": rep.push_seconds, "bytes": rep.bytes_sent,
                  "senders": len(ex.plan.groups) if ex else 1, "buckets_total": len(ex.plan.buckets) if ex else 1,
                  "failed_engines": rep.failed_engines, "repaired_from_disk": rep.repaired_from_disk,
                  "batched_engines": rep.stamped_with_push, "request_forms": ex.sent_forms if ex else {}}
        print(json.dumps(report), flush=True)
        with open(a.out, "w") as f:
            json.dump(report, f)
    destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
