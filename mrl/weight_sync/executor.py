"""Executes a weight-sync plan: gathers shards, converts to HF names, streams flattened buckets.

    sync = DistributedWeightSync(model=m, layout=layout, bridge=bridge, padded_vocab=vp,
                                 engines=[EngineEndpoint(url, tp=1)], bucket_bytes=512 << 20)
    sync.connect()            # one weight-update group per sender (PP stage x EP rank)
    stats = sync.push()       # every rank calls it; engines must be paused by the controller
    sync.close()

Per sender, bucket k is broadcast asynchronously while bucket k+1 is gathered (TP / expert-TP
all-gathers only, never the whole model on one rank). Each collective and HTTP call has a timeout.

Ordering: an SGLang engine serves one weight request at a time, and a broadcast completes only when
every engine of its group has reached the matching request. With several senders, two engines that
picked up different senders' requests first would wait on each other forever. So one process -- the
controller, trainer rank 0 -- posts every engine's requests (group inits, bucket updates, destroys)
in a single global order, one request at a time per engine, while each sender broadcasts its own
buckets in that same order.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from mrl.megatron import compat
from mrl.megatron.parallel import Layout
from mrl.megatron.weights import maps_by_name, gather_full_many, local_params
from mrl.models.bridge import ModelBridge, split_full
from mrl.rollout.client import EngineClient
from mrl.rollout.engine import free_port
from mrl.weight_sync.group import create_sender_group, destroy_sender_group
from mrl.weight_sync.planner import Bucket, SyncPlan, TrainerLayout, plan_sync

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineEndpoint:
    url: str
    tp: int = 1
    """Engine ranks that join each weight-update group (all GPUs of the server)."""


class _LoopThread:
    """An asyncio loop in a daemon thread, so blocking trainer code can keep HTTP calls in flight."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def submit(self, coro) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


@dataclass
class PushStats:
    seconds: float
    bytes_sent: int
    buckets_sent: int
    failed_engines: dict[str, str] = field(default_factory=dict)
    """url -> first error, for every engine whose weights may now be partial (union over senders)."""

    @property
    def ok(self) -> bool:
        return not self.failed_engines


@dataclass(frozen=True)
class SyncFault:
    """Test-only fault injection: declare (and send) bucket ``bucket`` with its first 2-D tensor one row
    short, as a trainer bug would; the engine must reject it ("partially updated")."""

    bucket: int = 0


def trainer_layout(layout: Layout, num_layers: int) -> TrainerLayout:
    c = layout.config
    return TrainerLayout(tp=c.tp, pp=c.pp, ep=c.ep, etp=c.expert_tp, world_size=layout.world_size, cp=c.cp,
                         stage_layers=tuple(c.stage_layers(num_layers)))


class DistributedWeightSync:
    def __init__(self, *, model: torch.nn.Module, layout: Layout, bridge: ModelBridge, padded_vocab: int,
                 engines: list[EngineEndpoint], bucket_bytes: int = 512 << 20, dtype: str = "float32",
                 master_address: str = "127.0.0.1", group_prefix: str = "mrl", timeout_s: float = 300.0,
                 fault: SyncFault | None = None):
        self.layout, self.engines, self.dtype, self.timeout_s = layout, engines, dtype, timeout_s
        self.fault = fault
        self.master_address = master_address
        self.maps = maps_by_name(bridge, padded_vocab)
        self.local = {lp.global_name: lp for lp in local_params(model, layout)}
        self.plan: SyncPlan = plan_sync(bridge.param_maps(padded_vocab), trainer_layout(layout, bridge.num_layers),
                                        num_layers=bridge.num_layers, num_experts=bridge.num_experts,
                                        bucket_bytes=bucket_bytes, dtype=dtype, tied=bridge.tied_embeddings,
                                        group_prefix=group_prefix)
        me = layout.world_rank
        self.group_name = self.plan.groups.get(me)
        self.is_sender = self.group_name is not None
        self.is_controller = me == 0
        self._pg = None
        self._io = _LoopThread() if self.is_controller else None
        self._clients = [EngineClient(e.url) for e in engines] if self.is_controller else []
        # every bucket touching my stage, in the global order, so group members run their gathers in step
        stage = layout.pp.rank
        self._global = sorted(self.plan.buckets, key=lambda b: (b.index, b.sender))
        self._order = [b for b in self._global if any(p.stage == stage for p in b.params)]
        self._identity = {p.mcore_name: _row_identity(self.maps[p.mcore_name], p)
                          for b in self.plan.for_sender(me) for p in b.params}

    # -- controller: every engine request, one global order -------------------------------------
    def _post_in_order(self, make_calls) -> Future:
        """Per engine, await each request before the next; returns a future of {url: first error}."""

        async def one_engine(client: EngineClient, calls) -> str | None:
            first = None
            for call in calls:
                try:
                    await call(client)
                except Exception as e:  # record, and keep going: the senders' broadcasts must stay matched
                    first = first or str(e)
            return first

        async def all_engines():
            errs = await asyncio.gather(*(one_engine(c, make_calls()) for c in self._clients))
            return {c.url: e for c, e in zip(self._clients, errs) if e is not None}

        return self._io.submit(all_engines())

    # -- groups ----------------------------------------------------------------------------------
    def connect(self) -> None:
        """One weight-update group per sender with every engine rank; all trainer ranks call it."""
        port = free_port(self.master_address) if self.is_sender else None
        ports = [None] * self.layout.world_size
        dist.all_gather_object(ports, port)
        world = 1 + sum(e.tp for e in self.engines)
        offsets = {e.url: 1 + sum(x.tp for x in self.engines[:i]) for i, e in enumerate(self.engines)}
        fut = None
        if self.is_controller:
            def calls():
                return [lambda c, r=r, g=g: c.init_weights_update_group(
                    master_address=self.master_address, master_port=ports[r], rank_offset=offsets[c.url],
                    world_size=world, group_name=g, backend=compat.BACKEND) for r, g in sorted(self.plan.groups.items())]

            fut = self._post_in_order(calls)
        if self.is_sender:
            self._pg = create_sender_group(master_address=self.master_address, master_port=port, world_size=world,
                                           group_name=self.group_name, backend=compat.BACKEND,
                                           timeout_s=self.timeout_s)
        if fut is not None:
            errs = fut.result(self.timeout_s * max(1, len(self.plan.groups)))
            if errs:
                raise RuntimeError(f"weight sync: engines failed to join the weight-update groups: {errs}")
        dist.barrier()

    def close(self) -> None:
        fut = None
        if self.is_controller:
            # both sides tear down at once: an NCCL communicator's destroy can wait for its peers
            fut = self._post_in_order(lambda: [lambda c, g=g: c.destroy_weights_update_group(g)
                                               for g in self.plan.groups.values()])
        if self._pg is not None:
            destroy_sender_group(self._pg)
        if fut is not None:
            fut.result(self.timeout_s)
            self._io.close()
        dist.barrier()

    # -- one sync --------------------------------------------------------------------------------
    def _gather_bucket(self, bucket: Bucket) -> list[tuple] | None:
        """Join the gathers this rank belongs to (one all-gather per group and dtype); the bucket's
        sender gets ``(planned param, param map, full tensor)`` per param, in bucket order."""
        me = self.layout.world_rank
        items, planned = [], []
        for p in bucket.params:
            lp = self.local.get(p.mcore_name)
            if lp is None:
                continue
            # only the DP (expert-DP) replica 0 gathers: the sender's group
            if (self.layout.edp.rank if lp.is_expert else self.layout.dp.rank) != 0:
                continue
            if lp.shard_group is None and me != bucket.sender:
                continue
            items.append((lp, self.maps[p.mcore_name]))
            planned.append(p)
        fulls = gather_full_many(items)
        if me != bucket.sender:
            return None
        return [(p, pm, full) for p, (_, pm), full in zip(planned, items, fulls)]

    def _flatten(self, bucket: Bucket, gathered: list[tuple]) -> torch.Tensor:
        """The bucket's bytes in ``flattened_bucket`` order. A param whose HF tensors are its own rows in
        order (experts' [gate; up], down, norms, ...: ``_row_identity``) goes in as one piece; only the
        others (q/k/v interleaved per KV group, vocab padding) are split per HF tensor."""
        dtype = _TORCH_DTYPES[self.dtype]
        pieces = []
        for p, pm, full in gathered:
            if self._identity[p.mcore_name]:
                pieces.append(full.to(dtype).reshape(-1).view(torch.uint8))
            else:
                hf = split_full(pm, full)
                pieces += [hf[t.name].to(dtype).contiguous().view(-1).view(torch.uint8) for t in p.tensors]
        return torch.cat(pieces)

    def _bucket_meta(self, bucket: Bucket):
        meta = bucket.tensors
        if self.fault is not None and bucket.index == self.fault.bucket:
            meta = _cut_one_row(meta)
        return meta

    def push(self) -> PushStats:
        """Stream every bucket to every engine; all trainer ranks call it. Engines must be paused (and
        flushed) by the controller. Never raises for engine-side failures: they are collected (all
        ranks get the union) so the controller can repair those engines -- never a silent partial update."""
        t0 = time.perf_counter()
        posted = None
        if self.is_controller:
            def calls():
                return [lambda c, b=b, m=self._bucket_meta(b): c.update_weights_from_distributed(
                    names=[t.name for t in m], dtypes=[t.dtype for t in m], shapes=[list(t.shape) for t in m],
                    group_name=b.group, load_format="flattened_bucket", flush_cache=False) for b in self._global]

            posted = self._post_in_order(calls)
        pending = None
        sent = nbytes = 0
        failed: dict[str, str] = {}
        for bucket in self._order:
            gathered = self._gather_bucket(bucket)
            if gathered is None or failed:
                continue  # still joined the gathers above, so the other ranks never wait on us
            flat = self._flatten(bucket, gathered)
            if self.fault is not None and bucket.index == self.fault.bucket:  # test hook: one row short
                flat = _cut_bytes(flat, bucket.tensors, self._bucket_meta(bucket), _TORCH_DTYPES[self.dtype])
            if pending is not None:
                self._finish(*pending, failed)
            work = dist.broadcast(flat.to(compat.DEVICE), src=0, group=self._pg, async_op=True)
            pending = (work, bucket)
            sent += 1
            nbytes += flat.numel()
        if pending is not None:
            self._finish(*pending, failed)
        if posted is not None:  # EngineHTTPError "...partially updated..." when an engine rejected a bucket
            for url, err in posted.result(self.timeout_s * max(1, len(self._global))).items():
                failed.setdefault(url, err)
        return PushStats(seconds=time.perf_counter() - t0, bytes_sent=nbytes, buckets_sent=sent,
                         failed_engines=union_failures(self.layout, failed))

    def _finish(self, work, bucket: Bucket, failed: dict[str, str]) -> None:
        try:
            if not work.wait(timeout=timedelta(seconds=self.timeout_s)):
                raise TimeoutError("timed out")
        except Exception as e:  # a dead engine breaks the collective for every engine of the group
            msg = f"broadcast of bucket {bucket.index} over {bucket.group} failed: {e}"
            for e_ in self.engines:
                failed.setdefault(e_.url, msg)


def union_failures(layout: Layout, failed: dict[str, str]) -> dict[str, str]:
    """Every rank's {engine url: first error}, merged, on every rank (collective)."""
    everyone = [None] * layout.world_size
    dist.all_gather_object(everyone, failed)
    union: dict[str, str] = {}
    for f in everyone:
        for url, err in f.items():
            union.setdefault(url, err)
    return union


def _numel(t) -> int:
    n = 1
    for d in t.shape:
        n *= d
    return n


def _row_identity(pm, planned) -> bool:
    """True when the full megatron tensor's rows are exactly the param's HF tensors, whole and in the
    bucket's order (so its bytes are theirs, concatenated)."""
    parts = [part for seg in pm.segments for part in seg]
    names = [part.hf_name for part in parts]
    rows = {t.name: t.shape[0] for t in planned.tensors}
    return (None not in names and names == [t.name for t in planned.tensors]
            and all(part.start == 0 and part.num_rows == rows[part.hf_name] for part in parts))


def _cut_bytes(flat: torch.Tensor, declared, sent, dtype: torch.dtype) -> torch.Tensor:
    """Test fault: drop the bytes of the row that ``sent`` (the cut meta) no longer declares."""
    elem = torch.empty((), dtype=dtype).element_size()
    out, off = [], 0
    for full_t, cut_t in zip(declared, sent):
        n = _numel(full_t) * elem
        out.append(flat[off:off + _numel(cut_t) * elem])
        off += n
    return torch.cat(out)


def _cut_one_row(meta):
    """Test fault: the first 2-D tensor declared (and, via _numel, sent) one row short."""
    i = next(i for i, t in enumerate(meta) if len(t.shape) == 2)
    t = meta[i]
    return meta[:i] + [type(t)(t.name, (t.shape[0] - 1,) + tuple(t.shape[1:]), t.dtype)] + meta[i + 1:]
