"""torchrun worker of bench/weight_sync_inflight.py: how long generation stops per sync, by pause mode.

    torchrun --nproc-per-node 1 bench/_inflight_worker.py --hf DIR --dtype bf16 --engine URL@TP \\
        --transport tensor --modes abort,in_place,retract --reps 8 --requests 32 --out inflight.json

The trainer side is mrl's real one: megatron model, ``FullWeightChannel`` with ``pause_mode`` set per sync. In
each repetition every mode runs once (their order rotated), each sync with ``--requests`` streamed greedy
requests decoding in the engine. A request's tokens arrive one per decode step; the generation pause of a sync
is, per request, the longest wait between two of its tokens around the sync, less its median wait (one decode
step), and the figure is the median over the requests. ``abort``: as in the loop, the requests are drained
first (aborted, their partial outputs back), then the sync runs and each is resubmitted as prompt + partial, as
the rollout manager does; the wait runs from its last token before the abort to its first token after the
resubmission (the drain and the re-prefill included).
Every token's version tag is checked: tokens that arrived before the sync began were made by the old weights,
those after it ended by the new ones (``version_errors`` counts the others). ``version_errors_past_launched``
lets each request's first token after the sync be old: with SGLang's overlap scheduler (GPU engines) the forward
pass launched before an in-place pause or a staged swap is processed after the sync, so its token arrives late
though the old weights computed it, and the tag (taken when the forward pass is launched) says so. Arrival times
cannot tell a tag read one step late (that token would arrive late tagged new): only logprobs against a reference
can (``tests/integration/test_inflight_sync.py``, CPU engines without overlap).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from mrl.config.schema import WeightTransport
from mrl.jobs.common import add_layout_args, load_model
from mrl.megatron.parallel import destroy
from mrl.sglang.client import EngineClient
from mrl.sglang.endpoint import EngineEndpoint
from mrl.sglang.wire import TOKEN_VERSIONS_KEY
from mrl.weight_sync.factory import make_transport
from mrl.weight_sync.full import FullWeightChannel
from mrl.weight_sync.transport import LoopThread


class Stream:
    """One streamed greedy request: (arrival time, tokens so far) per chunk, its tokens and their version tags."""

    def __init__(self, client: EngineClient, prompt: list[int], new: int, rid: str):
        self.client, self.prompt, self.new, self.rid = client, prompt, new, rid
        self.arrivals: list[tuple[float, int]] = []
        self.ids: list[int] = []
        self.tags: list = []
        self.finish: str | None = None

    async def run(self, offset: int = 0, ids: list[int] | None = None) -> None:
        """Stream the request (``ids``: the tokens so far, for a resubmission; arrivals count on from them)."""
        body = {"input_ids": self.prompt + (ids or []), "rid": self.rid + f"-{offset}", "stream": True,
                "sampling_params": {"max_new_tokens": self.new - offset, "temperature": 0.0, "ignore_eos": True}}
        async with self.client._session().post(self.client.url + "/generate", json=body,
                                               headers=self.client.auth_headers()) as r:
            r.raise_for_status()
            async for line in r.content:
                line = line.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "meta_info" not in chunk:
                    raise RuntimeError(f"{self.rid}: the engine streamed {chunk!r:.300}")
                meta = chunk["meta_info"]
                now = time.perf_counter()
                n = offset + meta["completion_tokens"]
                if not self.arrivals or n > self.arrivals[-1][1]:
                    self.arrivals.append((now, n))
                self.tags = self.tags[:offset] + list(meta.get(TOKEN_VERSIONS_KEY) or [])
                self.ids = (ids or [])[:offset] + list(chunk.get("output_ids") or [])
                fr = meta.get("finish_reason")
                self.finish = fr.get("type") if isinstance(fr, dict) else None

    def tokens(self) -> int:
        return self.arrivals[-1][1] if self.arrivals else 0

    def pause(self, t0: float, t1: float) -> float | None:
        """Seconds generation stopped for this request around the sync window [t0, t1], less one decode step;
        None for a request that was not generating across it (it had ended before, or began after)."""
        times = [t for t, _ in self.arrivals]
        gaps = [b - a for a, b in zip(times, times[1:])]
        around = [b - a for a, b in zip(times, times[1:]) if b >= t0 and a <= t1]
        return max(around) - statistics.median(gaps) if around else None

    def version_errors(self, t0: float, t1: float, old, new, launched_before: int = 0) -> int:
        """Tokens whose tag contradicts when they arrived (before the sync: old weights; after it: new), but for
        the first ``launched_before`` tokens after the sync, which may be old: SGLang's overlap scheduler
        processes the forward pass launched before an in-place pause or a staged swap after the sync, so that
        token arrives late though the old weights computed it. Tags must never go back to ``old`` either."""
        errs, last, seen_new, late = 0, 0, False, 0
        for t, n in self.arrivals:
            for i in range(last, min(n, len(self.tags))):
                tag = self.tags[i]
                if t > t1 and tag == old and not seen_new and late < launched_before:
                    late += 1
                    continue
                errs += (t < t0 and tag != old) or (t > t1 and tag != new) or (seen_new and tag != new)
                seen_new |= tag == new
            last = n
        return errs


async def _until(streams, tokens: int, tasks=(), timeout: float = 600.0) -> None:
    """Until every stream has ``tokens`` tokens; a stream that failed (``tasks``) raises its error."""
    deadline = time.monotonic() + timeout
    while min(s.tokens() for s in streams) < tokens:
        for t in tasks:
            if t.done() and t.exception() is not None:
                raise t.exception()
        if time.monotonic() > deadline:
            raise TimeoutError(f"requests did not reach {tokens} tokens")
        await asyncio.sleep(0.005)


def one_sync(io: LoopThread, client: EngineClient, syncer: FullWeightChannel, mode: str, version: int, vocab: int,
             a) -> dict:
    gen = torch.Generator().manual_seed(version)
    streams = [Stream(client, torch.randint(3, vocab, (a.prompt_len,), generator=gen).tolist(), a.new,
                      f"inflight-v{version}-{i}") for i in range(a.requests)]
    tasks = [io.submit(s.run()) for s in streams]
    io.submit(_until(streams, a.before, tasks)).result(900)
    syncer.pause_mode = mode
    t0 = time.perf_counter()
    if mode == "abort":  # the loop's drain: abort every request and wait for their partial outputs
        io.submit(client.abort(abort_all=True)).result(60)
        for t in tasks:
            t.result(60)
    rep = syncer.sync(str(version))
    t1 = time.perf_counter()
    if mode == "abort":  # resubmitted as prompt + partial output, as the rollout manager does
        tasks = [io.submit(s.run(len(s.ids), list(s.ids))) for s in streams]
    io.submit(_until(streams, a.before + a.after, tasks)).result(900)
    io.submit(client.abort(abort_all=True)).result(60)
    for t in tasks:
        try:
            t.result(60)
        except Exception:  # noqa: BLE001 -- the abort ends each stream, however it ends
            pass
    pauses = [p for p in (s.pause(t0, t1) for s in streams) if p is not None]
    if not pauses:
        raise RuntimeError(f"sync {version} ({mode}): no request was generating across it (each had ended before "
                           "or began after): lower --new, or fewer --requests than the engine runs at once")
    return {"mode": mode, "version": version, "generation_pause_ms": 1e3 * statistics.median(pauses),
            "requests_across_sync": len(pauses),
            "generation_pause_ms_max": 1e3 * max(pauses), "sync_ms": 1e3 * (t1 - t0),
            "phase_ms": {k: 1e3 * v for k, v in rep.phase_seconds.items()},
            "version_errors": sum(s.version_errors(t0, t1, version - 1, version) for s in streams),
            "version_errors_past_launched": sum(s.version_errors(t0, t1, version - 1, version, 1) for s in streams),
            "tokens_per_request": statistics.median(s.tokens() for s in streams)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    add_layout_args(ap)
    ap.add_argument("--engine", required=True, help="url@tp")
    ap.add_argument("--transport", default="distributed", choices=[t.value for t in WeightTransport])
    ap.add_argument("--bucket-mb", type=float, default=512)
    ap.add_argument("--modes", default="abort,in_place,retract,staged")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=1024, help="each request's budget (never reached: aborted after)")
    ap.add_argument("--before", type=int, default=16, help="tokens each request has when the sync starts")
    ap.add_argument("--after", type=int, default=16, help="tokens each request gets after it, before the abort")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)

    m = load_model(a)
    layout = m.layout
    url, _, tp = a.engine.partition("@")
    engines = [EngineEndpoint(url, int(tp or 1))]
    transport, disk = make_transport(WeightTransport(a.transport), model=m.model, layout=layout, bridge=m.bridge,
                                     padded_vocab=m.padded_vocab, engines=engines,
                                     bucket_bytes=int(a.bucket_mb * (1 << 20)), export_dir=tempfile.mkdtemp(),
                                     config_src=a.hf, dtype="float32" if a.dtype == "fp32" else "bfloat16")
    syncer = FullWeightChannel(transport, disk, layout, engines, model=m.model)
    syncer.connect()
    modes = a.modes.split(",")
    rows, version = [], 0
    io = LoopThread() if layout.world_rank == 0 else None
    client = EngineClient(engines[0]) if io else None
    for rep in range(a.reps + 1):  # the first round warms every mode up and is left out
        for mode in modes[rep % len(modes):] + modes[:rep % len(modes)]:
            version += 1
            if layout.world_rank == 0:
                row = one_sync(io, client, syncer, mode, version, m.bridge.vocab_size, a)
                row["warmup"] = rep == 0
                rows.append(row)
                print(json.dumps(row), flush=True)
            else:  # the other ranks send their buckets
                syncer.pause_mode = mode
                syncer.sync(str(version))
    syncer.close()
    if layout.world_rank == 0:
        io.submit(client.close()).result(30)
        with open(a.out, "w") as f:
            json.dump({"rows": rows, "transport": a.transport, "requests": a.requests, "prompt_len": a.prompt_len,
                       "engine": a.engine}, f)
    dist.barrier()
    destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
