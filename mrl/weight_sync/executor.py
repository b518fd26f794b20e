"""The bucket executor the distributed and tensor transports share: runs a weight-sync plan, gathers shards,
converts to HF names, streams flattened buckets.

    ex = BucketExecutor(model=m, layout=layout, bridge=bridge, padded_vocab=vp,
                        engines=[EngineEndpoint(url, tp=1)], bucket_bytes=512 << 20)
    ex.connect()              # one weight-update group per sender (PP stage x EP rank)
    stats = ex.push()         # every rank calls it; engines must be paused by the controller
    ex.close()

Per sender, bucket k is broadcast asynchronously while bucket k+1 is gathered (TP / expert-TP
shards to the sender only, never the whole model on one rank) into the other of two reused send
buffers. What goes where is a static copy plan (``copy_plan``), built on the first push and replayed:
a few batched copies per bucket, no per-tensor Python, no allocation, and on GPU no host sync before
the last bucket (gloo runs one broadcast at a time). Each collective and HTTP call has a timeout.

Ordering: an SGLang engine serves one weight request at a time, and a broadcast completes only when
every engine of its group has reached the matching request. With several senders, two engines that
picked up different senders' requests first would wait on each other forever. So one process -- the
controller, trainer rank 0 -- posts every engine's requests (group inits, bucket updates, destroys)
in a single global order, one request at a time per engine, while each sender broadcasts its own
buckets in that same order. The requests of one engine are pipelined on one HTTP connection
(``mrl.sglang.pipeline``): the server takes them strictly in order, and bucket k+1's request is already
waiting in the engine when bucket k completes.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from concurrent.futures import Future
from datetime import timedelta
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from mrl.megatron import compat
from mrl.megatron.parallel import Layout
from mrl.megatron.weights import maps_by_name, gather_full_many, local_params
from mrl.models.bridge import ModelBridge
from mrl.sglang.client import EngineClient, close_clients
from mrl.sglang.endpoint import free_port, route_address
from mrl.sglang.wire import BATCHED_BUCKETS_FORMAT, LAYOUT_KEPT_MARK, STAGED_FORMAT
from mrl.sglang.protocol import (EngineGuardError, EngineHTTPError, EngineProtocolError,
                                  EngineUnavailable, error_message, parse_success)
from mrl.weight_sync.copy_plan import BucketStep, build_steps, placement
from mrl.weight_sync.group import abort_sender_group, create_sender_group, destroy_sender_group
from mrl.sglang.pipeline import post_pipelined
from mrl.weight_sync.planner import Bucket, SyncPlan, TrainerLayout, plan_sync
from mrl.sglang.endpoint import EngineEndpoint
from mrl.weight_sync.transport import LoopThread, PushStats, any_rank, union_failures

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def trainer_layout(layout: Layout, num_layers: int) -> TrainerLayout:
    c = layout.config
    return TrainerLayout(tp=c.tp, pp=c.pp, ep=c.ep, etp=c.expert_tp, world_size=layout.world_size, cp=c.cp,
                         stage_layers=tuple(c.stage_layers(num_layers)))


class PushWatch:
    """The phase boundaries of a push, for whoever times them (``BucketExecutor.watch``); this one does nothing.
    Per push: ``begin``, then per bucket step ``bucket(step)`` and ``mark(phase)`` as each phase ends
    (``settle_before``, ``fill``, on gloo ``settle_previous``, ``issue``), then ``bucket(None)``,
    ``mark("settle_last")`` and on the controller ``mark("engine_answers")``; ``posted`` when the controller's
    update requests to an engine leave (its HTTP loop's thread)."""

    def begin(self) -> None:
        pass

    def bucket(self, step: BucketStep | None) -> None:
        pass

    def mark(self, phase: str) -> None:
        pass

    def posted(self) -> None:
        pass


class BucketExecutor:
    def __init__(self, *, model: torch.nn.Module, layout: Layout, bridge: ModelBridge, padded_vocab: int,
                 engines: list[EngineEndpoint], bucket_bytes: int = 512 << 20, dtype: str = "float32",
                 master_address: str | None = None, group_prefix: str = "mrl", timeout_s: float = 300.0,
                 chunk_bytes: int = 0, fp8: bool = False, fp8_ignore: tuple[str, ...] = ()):
        """``fp8``: the engines serve a block-FP8 checkpoint (``engine.quantization=fp8``): its targets go as
        e4m3 weights with fp32 scales, quantized by the senders from ``dtype`` (``mrl.weight_sync.fp8``), but
        the modules ``fp8_ignore`` keeps in high precision (``engine.fp8_ignore``, as the export)."""
        self.layout, self.engines, self.dtype, self.timeout_s = layout, engines, dtype, timeout_s
        self.fp8, self.fp8_ignore = fp8, tuple(fp8_ignore)
        self.chunk_bytes = chunk_bytes  # shard transfers split into chunks of this size (copy_plan.build_steps)
        self.master_address = master_address
        self.maps = maps_by_name(bridge, padded_vocab)
        self.local = {lp.global_name: lp for lp in local_params(model, layout)}
        self._planning = dict(maps=bridge.param_maps(padded_vocab), layout=trainer_layout(layout, bridge.num_layers),
                              num_layers=bridge.num_layers, num_experts=bridge.num_experts, bucket_bytes=bucket_bytes,
                              dtype=dtype, tied=bridge.tied_embeddings, group_prefix=group_prefix, fp8=fp8,
                              fp8_ignore=self.fp8_ignore)
        self._replan(plan_sync(**self._planning))
        me = layout.world_rank
        self.group_name = self.plan.groups.get(me)
        self.is_sender = self.group_name is not None
        self.is_controller = me == 0
        self._pg = None
        self._members_gone = False  # an engine of the groups was found dead or hung (``forget``)
        self._io = LoopThread() if self.is_controller else None
        self.clients = [EngineClient(e) for e in engines] if self.is_controller else []
        """The controller's, one per engine: an engine whose client holds ``batched_groups`` takes every bucket
        of a sync in one request."""
        self.watch = PushWatch()
        self.staged = False  # the requests' load_format marked STAGED_FORMAT (``Transport.staged``)

    def _replan(self, plan: SyncPlan) -> None:
        self.plan = plan
        # every bucket touching my stage, in the global order, so group members run their gathers in step
        stage = self.layout.pp.rank
        self._global = sorted(plan.buckets, key=lambda b: (b.index, b.sender))
        self.order = [b for b in self._global if any(p.stage == stage for p in b.params)]
        self._steps: list[BucketStep] | None = None  # the copy plan, built on the first push
        self._sources: tuple[list[torch.Tensor], list[int]] = ([], [])  # params the plan's views read, data_ptrs
        self._bodies: list[bytes] | None = None  # controller: each bucket's request, in the global order
        self._batched: dict[str, bytes] | None = None  # controller: every bucket in one request per form,
        # but its closing version (``_batched_body``)
        self.layout_key = ""  # the engines keep the batched request's tensor lists under it
        self.sent_forms: dict[str, str] = {}  # controller: per engine, the last push's request (``_batched_body``)

    def place_buckets(self) -> None:
        """Collective: re-plan with every sender's in-place params (``planner.Placement``: in megatron's
        DDP parameter buffer these go out without a copy). ``connect`` calls it; the groups stay."""
        me, dtype = self.layout.world_rank, TORCH_DTYPES[self.dtype]
        mine = {}
        for p in (p for b in self.plan.buckets for p in b.params):  # the planned params, whatever their buckets
            lp = self.local.get(p.mcore_name)
            if p.sender == me and lp is not None:
                at = placement(lp, self.maps[p.mcore_name], p, dtype)
                if at is not None:
                    mine[p.mcore_name] = at
        everyone = [None] * self.layout.world_size
        dist.all_gather_object(everyone, mine)
        placements = {k: v for d in everyone for k, v in d.items()}
        self._replan(plan_sync(**self._planning, placements=placements, min_inplace_bytes=self._min_inplace_bytes()))

    def _min_inplace_bytes(self) -> int:
        """Shortest run of params sent in place rather than copied into a bucket with others. Each bucket
        costs a request and a broadcast. On gloo a copy cannot overlap the broadcasts (one at a time), so
        runs worth about a millisecond of copying (8 MiB) win. On GPU a copy is nearly free and overlaps
        the previous bucket's broadcast, so only runs that fill a whole bucket go in place: shorter ones
        would only add buckets (docs/weight_sync.md)."""
        b = self._planning["bucket_bytes"]
        return b if compat.HAS_CUDA else min(b // 4, 8 << 20)

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
            errs = await asyncio.gather(*(one_engine(c, make_calls()) for c in self.clients))
            return {c.url: e for c, e in zip(self.clients, errs) if e is not None}

        return self._io.submit(all_engines())

    # -- groups ----------------------------------------------------------------------------------
    def connect(self) -> None:
        """One weight-update group per sender with every engine rank; all trainer ranks call it."""
        self.place_buckets()
        # each sender hosts its own group's store: engines dial that sender's address (on its interface
        # towards the engines, unless configured), so senders on several trainer nodes each get theirs
        addr = None
        if self.is_sender:
            addr = self.master_address or route_address(urlsplit(self.engines[0].url).hostname)
        port = free_port(addr) if self.is_sender else None
        stores = [None] * self.layout.world_size
        dist.all_gather_object(stores, (addr, port))
        world = 1 + sum(e.tp for e in self.engines)
        offsets = {e.url: 1 + sum(x.tp for x in self.engines[:i]) for i, e in enumerate(self.engines)}
        fut = None
        if self.is_controller:
            def calls():
                return [lambda c, r=r, g=g: c.init_weights_update_group(
                    master_address=stores[r][0], master_port=stores[r][1], rank_offset=offsets[c.url],
                    world_size=world, group_name=g, backend=compat.BACKEND)
                for r, g in sorted(self.plan.groups.items())]

            fut = self._post_in_order(calls)
        if self.is_sender:
            self._pg = create_sender_group(master_address=addr, master_port=port, world_size=world,
                                           group_name=self.group_name, backend=compat.BACKEND,
                                           timeout_s=self.timeout_s)
        if fut is not None:
            errs = fut.result(self.timeout_s * max(1, len(self.plan.groups)))
            if errs:
                raise RuntimeError(f"weight sync: engines failed to join the weight-update groups: {errs}")
        dist.barrier()

    def forget(self, urls: list[str]) -> None:
        """Dead or hung engines: no teardown requests to them, and the groups they belong to are aborted,
        not destroyed (an NCCL communicator's destroy can wait on a stopped peer)."""
        gone = [c for c in self.clients if c.url in urls]
        if gone:
            self.clients = [c for c in self.clients if c.url not in urls]
            self._io.submit(close_clients(gone)).result(30)
        self._members_gone = self._members_gone or any(e.url in urls for e in self.engines)

    def close(self) -> None:
        fut = None
        if self.is_controller:
            # both sides tear down at once: an NCCL communicator's destroy can wait for its peers
            fut = self._post_in_order(lambda: [lambda c, g=g: c.destroy_weights_update_group(g)
                                               for g in self.plan.groups.values()])
        if self._pg is not None:  # None after an abort (a failed push): already torn down
            (abort_sender_group if self._members_gone else destroy_sender_group)(self._pg)
            self._pg = None
        self.release_buffers()
        if fut is not None:
            fut.result(self.timeout_s)
            self._io.submit(close_clients(self.clients)).result(30)
            self._io.close()
        dist.barrier()

    # -- one sync --------------------------------------------------------------------------------
    def gather_bucket(self, bucket: Bucket) -> list[tuple] | None:
        """Join the gathers this rank belongs to (one all-gather per group and dtype); the bucket's
        sender gets ``(planned param, param map, full tensor)`` per param, in bucket order. The
        per-tensor path: the tensor transport sends tensors one by one, and tests check the copy plan
        against it."""
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

    def steps(self) -> list[BucketStep]:
        """This rank's copy plan (cached; rebuilt when a param's storage moved, e.g. after offloading)."""
        params, ptrs = self._sources
        if self._steps is None or list(map(torch.Tensor.data_ptr, params)) != ptrs:  # ~0.1 us a param
            self._steps = None  # drop the old buffers first
            steps, sources = build_steps(self.order, self.local, self.maps, rank=self.layout.world_rank,
                                         dp_rank=self.layout.dp.rank, edp_rank=self.layout.edp.rank,
                                         dtype=TORCH_DTYPES[self.dtype], device=compat.DEVICE,
                                         chunk_bytes=self.chunk_bytes)
            self._steps, self._sources = steps, (sources, list(map(torch.Tensor.data_ptr, sources)))
        return self._steps

    def release_buffers(self) -> None:
        """Free the send and gather buffers (2 buckets + one bucket's shards); the next push rebuilds them."""
        self._steps, self._sources = None, ([], [])

    def push(self, version: str | None = None) -> PushStats:
        """Stream every bucket to every engine; all trainer ranks call it. Engines must be paused (and
        flushed) by the controller. Never raises for engine-side failures: they are collected (all
        ranks get the union) so the controller can repair those engines -- never a silent partial update.
        Engines that take a sync's buckets in one request get ``version`` stamped with it (``PushStats.stamped``)."""
        if self.broken:
            raise RuntimeError("weight sync: push without a weight-update group (not connected, or torn down by "
                               "a failed push: FullWeightChannel reconnects)")
        t0 = time.perf_counter()
        posted = self._post_updates(version) if self.is_controller else None
        steps = self.steps()
        in_flight: dict[int, tuple] = {}  # send buffer slot -> (work, bucket) of its last broadcast
        sent = nbytes = in_place = 0
        failed: dict[str, str] = {}
        watch = self.watch
        watch.begin()
        for step in steps:
            watch.bucket(step)
            if step.flat is not None and step.slot in in_flight:  # the buffer is free once its broadcast is done
                self._settle(*in_flight.pop(step.slot), failed, block=not compat.HAS_CUDA)
            if failed and self._pg is not None:
                self._abort(in_flight)
            watch.mark("settle_before")
            step.fill()  # joins the gathers even after a failure, so the other ranks never wait on us
            watch.mark("fill")
            if step.flat is None or failed:
                continue
            if not compat.HAS_CUDA:  # gloo: one broadcast at a time (receivers buffer early data: copies)
                for slot in list(in_flight):
                    self._settle(*in_flight.pop(slot), failed, block=True)
                if failed:
                    self._abort(in_flight)
                    continue
                watch.mark("settle_previous")
            flat = step.flat
            in_flight[step.slot] = (dist.broadcast(flat, src=0, group=self._pg, async_op=True), step.bucket)
            watch.mark("issue")
            sent += 1
            nbytes += flat.numel()
            in_place += flat.numel() if step.in_place else 0
        watch.bucket(None)
        for work, bucket in list(in_flight.values()):
            self._settle(work, bucket, failed, block=True)
        watch.mark("settle_last")
        if failed and self._pg is not None:
            self._abort(in_flight)
        stamped: list[str] = []
        if posted is not None:  # EngineHTTPError "...partially updated..." when an engine rejected a bucket
            errs, stamped = posted.result(self.timeout_s * max(1, len(self._global)))
            for url, err in errs.items():
                failed.setdefault(url, err)
            watch.mark("engine_answers")
        failed = union_failures(self.layout, failed)
        broken = bool(failed) and any_rank(self.layout, self.broken)  # only then a collective: ranks agree on failed
        return PushStats(seconds=time.perf_counter() - t0, bytes_sent=nbytes, buckets_sent=sent,
                         bytes_in_place=in_place, failed_engines=failed, groups_broken=broken,
                         stamped=[u for u in stamped if u not in failed])

    @property
    def broken(self) -> bool:
        """A failed broadcast tore this sender's group down: the groups must be rebuilt (``FullWeightChannel``)."""
        return self.is_sender and self._pg is None

    def _abort(self, in_flight: dict) -> None:
        """Stop this sender's push at its first failed broadcast and tear its group down, so every engine
        still waiting in the group fails its remaining bucket requests at once (``abort_sender_group``);
        the gathers go on, so the other trainer ranks never wait on this one."""
        in_flight.clear()  # the works keep the group's connections alive
        pg, self._pg = self._pg, None
        abort_sender_group(pg)

    def _settle(self, work, bucket: Bucket, failed: dict[str, str], *, block: bool) -> None:
        """Wait for a broadcast: on the host (``block``, with the timeout), or on CUDA only by ordering
        the current stream after it (no host sync; a hang is caught by the final blocking settle)."""
        try:
            if not block:
                work.wait()
            elif compat.HAS_CUDA:  # NCCL's wait(timeout) polls in 1 ms sleeps: poll the event finer
                deadline = time.monotonic() + self.timeout_s
                while not work.is_completed():
                    if time.monotonic() > deadline:
                        raise TimeoutError("timed out")
                    time.sleep(20e-6)
                work.wait()
            elif not work.wait(timeout=timedelta(seconds=self.timeout_s)):
                raise TimeoutError("timed out")
        except Exception as e:  # a dead engine breaks the collective for every engine of the group
            msg = f"broadcast of bucket {bucket.index} over {bucket.group} failed: {e}"
            for e_ in self.engines:
                failed.setdefault(e_.url, msg)

    # -- controller: the bucket requests ---------------------------------------------------------
    def _request_bodies(self) -> list[bytes]:
        """Every bucket's request in the global order; static, so encoded once (the version is stamped
        after the sync by ``update_weight_version``)."""
        if self._bodies is None:
            self._bodies = []
            for b in self._global:
                m = b.tensors
                self._bodies.append(json.dumps(dict(
                    names=[t.name for t in m], dtypes=[t.dtype for t in m], shapes=[list(t.shape) for t in m],
                    group_name=b.group, flush_cache=False, weight_version=None,
                    load_format=self._format("flattened_bucket"))).encode())
        return self._bodies

    def _format(self, fmt: str) -> str:
        return STAGED_FORMAT + fmt if self.staged else fmt

    def _batched_body(self, version: str | None, form: str = "keep") -> bytes:
        """Every bucket in one request, in the global order (``mrl.sglang.wire.BATCHED_BUCKETS_FORMAT``), with the
        weight version the engine takes on success; the rest is encoded once. ``form``: ``keep`` (the tensor
        lists, kept by the engine under ``layout_key``), ``kept`` (only that key: the engine answered it as
        kept) or ``plain`` (the lists, for an engine that keeps none)."""
        return self._batched_forms()[form] + f', "weight_version": {json.dumps(version)}}}'.encode()

    def _batched_forms(self) -> dict[str, bytes]:
        """Each form's static part, encoded once (it sets ``layout_key``)."""
        if self._batched is None:
            metas = [b.tensors for b in self._global]
            layout = [[b.group, len(m)] for b, m in zip(self._global, metas)]
            lists = dict(names=[t.name for m in metas for t in m], dtypes=[t.dtype for m in metas for t in m],
                         shapes=[list(t.shape) for m in metas for t in m])
            self.layout_key = hashlib.sha256(json.dumps([layout, lists]).encode()).hexdigest()[:16]
            empty = dict(names=[], dtypes=[], shapes=[])
            specs = {"plain": (lists, layout), "keep": (lists, {"key": self.layout_key, "layout": layout}),
                     "kept": (empty, {"key": self.layout_key})}
            self._batched = {f: json.dumps(dict(**body, group_name=self._global[0].group, flush_cache=False,
                                                load_format=self._format(BATCHED_BUCKETS_FORMAT + json.dumps(spec))
                                                ))[:-1].encode()
                             for f, (body, spec) in specs.items()}
        return self._batched

    def _post_updates(self, version: str | None) -> Future:
        """Every bucket request to every engine, pipelined per engine (or, where the engine takes them, all
        buckets in one request); a future of ({url: first error}, [urls stamped with ``version``])."""
        bodies = self._request_bodies()
        groups = {b.group for b in self._global}
        self._batched_forms()  # sets layout_key before any engine's form is chosen
        ep = "/update_weights_from_distributed"

        async def one_engine(client: EngineClient) -> tuple[str | None, bool]:
            missing = sorted(groups - client.groups)
            if missing:  # an unknown group kills the 0.5.10 scheduler: send nothing
                return str(EngineGuardError(client.url, ep, f"groups {missing} were not created by this client")), False
            one = groups <= client.batched_groups
            form = ("kept" if self.layout_key in client.kept_layouts else "keep") if client.keeps_layouts else "plain"
            self.sent_forms[client.url] = form if one else "per_bucket"
            self.watch.posted()
            answers = await post_pipelined(client.url, ep, [self._batched_body(version, form)] if one else bodies,
                                           timeout=client.timeouts.weight_update,
                                           connect_timeout=client.timeouts.connect,
                                           headers=client.auth_headers(admin=True))  # weight updates: admin key
            first = None
            for a in answers:
                try:
                    message = _check_answer(client.url, ep, a)
                    if one and f"{LAYOUT_KEPT_MARK}{self.layout_key}]" in message:
                        client.kept_layouts.add(self.layout_key)
                except Exception as e:  # record, and keep going: the senders' broadcasts stay matched
                    first = first or str(e)
            return first, one and first is None and version is not None

        async def all_engines():
            res = await asyncio.gather(*(one_engine(c) for c in self.clients))
            return ({c.url: e for c, (e, _) in zip(self.clients, res) if e is not None},
                    [c.url for c, (_, stamped) in zip(self.clients, res) if stamped])

        return self._io.submit(all_engines())


def _check_answer(url: str, ep: str, answer) -> str:
    """An update's answer as ``EngineClient`` reads it: 200/400 with ``{success, message}``."""
    if isinstance(answer, Exception):
        raise answer
    status, raw = answer
    text = raw.decode("utf-8", "replace")
    try:
        body = json.loads(text) if text else None
    except ValueError:
        body = None
    if status in (502, 503, 504):
        raise EngineUnavailable(url, ep, f"HTTP {status}: {error_message(body, text)}")
    if status not in (200, 400):
        raise EngineHTTPError(url, ep, status, error_message(body, text))
    if body is None:
        raise EngineProtocolError(url, ep, f"HTTP {status}: not JSON: {text[:160]!r}")
    return parse_success(body, (url, ep))
