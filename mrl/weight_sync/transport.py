"""The weight-transport interface and the types every transport shares (``factory.make_transport`` builds one).

    stats = transport.push("7")    # collective over the trainer ranks; the engines are paused already

One file per transport:

- ``distributed`` (``distributed.py``): SGLang's ``update_weights_from_distributed``, broadcast from
  parallel senders. The fast path on any cluster.
- ``disk`` (``disk.py``): safetensors export + ``update_weights_from_disk``. Slow, but it needs nothing
  beyond a shared file system, so it is also how every other transport repairs an engine.
- ``tensor`` (``tensor.py``): colocated engines (same node, same GPUs): CUDA IPC handles through
  ``update_weights_from_tensor``. GPU only.

Every transport's ``push`` is collective over the trainer ranks and never raises for engine-side
failures: they come back in ``PushStats.failed_engines`` and the sync sequence (``full.FullWeightChannel``)
reloads those engines from disk, so an engine is never left on a partial update.
"""

from __future__ import annotations

import abc
import asyncio
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mrl.sglang.endpoint import EngineEndpoint
from mrl.megatron import compat
from mrl.megatron.parallel import Layout
from mrl.sglang.client import ClientTimeouts, EngineClient, liveness
from mrl.sglang.wire import STAGED_FORMAT


@dataclass
class PushStats:
    seconds: float
    bytes_sent: int
    buckets_sent: int
    bytes_in_place: int = 0
    """Of ``bytes_sent``, broadcast straight from the params (no copy: ``copy_plan`` in-place buckets)."""
    failed_engines: dict[str, str] = field(default_factory=dict)
    """url -> first error, for every engine whose weights may now be partial (union over senders)."""
    groups_broken: bool = False
    """A broadcast failed and its group was torn down (on every rank's word): reconnect before the next push."""
    stamped: list[str] = field(default_factory=list)
    """Engines (urls; known on the controller) that took the new weight version with the push itself, so
    the sync sends them no version stamp of its own."""

    @property
    def ok(self) -> bool:
        return not self.failed_engines


class Transport(abc.ABC):
    """One way of moving the trainer's weights into the engines. All methods are collective."""

    name: str
    staged: bool = False
    """The engines load each push while they generate and swap it in at the sync's ``/continue_generation``
    (``weight_sync.pause_mode=staged``, ``mrl.engine.server.staged``); set by the channel."""

    def load_format(self, fmt: str | None) -> str | None:
        """An update request's ``load_format``: marked ``STAGED_FORMAT`` when the push is staged."""
        return STAGED_FORMAT + (fmt or "") if self.staged else fmt

    def connect(self) -> None:
        """Set up channels (process groups) once; re-called after an engine restart."""

    @abc.abstractmethod
    def push(self, version: str, engines: list[EngineEndpoint] | None = None) -> PushStats:
        """Move the current weights into ``engines`` (default: all); engines are already paused."""

    def forget(self, urls: list[str]) -> None:
        """Engines found dead or hung: ``close`` sends them nothing (a hung engine would hold each request to
        its limit). Not collective."""

    def close(self) -> None:
        """Tear the channels down."""


class LoopThread:
    """An asyncio loop in a daemon thread, so blocking trainer code can keep HTTP calls in flight."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def submit(self, coro) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


def run_on(engines: list[EngineEndpoint], call, loop: LoopThread | None = None,
           timeouts: ClientTimeouts | None = None,
           clients: dict[str, EngineClient] | None = None) -> dict[str, str]:
    """Run ``call(client)`` on every engine concurrently; {url: error} of those that failed. ``clients``
    (by url, used on ``loop``): the caller's, kept open; otherwise new ones, closed afterwards."""

    async def go():
        mine = clients is None
        cs = [EngineClient(e, **({"timeouts": timeouts} if timeouts else {})) if mine else clients[e.url]
              for e in engines]

        async def one(c):
            try:
                await call(c)
                return None
            except Exception as e:  # collected: the caller repairs or reports those engines
                return f"{type(e).__name__}: {e}"
            finally:
                if mine:
                    await c.close()

        errs = await asyncio.gather(*(one(c) for c in cs))
        return {e.url: err for e, err in zip(engines, errs) if err is not None}

    if loop is not None:
        return loop.submit(go()).result()
    return asyncio.run(go())


def dead_engines(urls: list[str], probe_timeout_s: float) -> dict[str, str]:
    """{url: why} of those engines that fail a liveness probe now (``client.liveness``: killed, stopped or
    wedged); the others are alive."""

    async def go():
        clients = [EngineClient(u) for u in urls]
        try:
            return await asyncio.gather(*(liveness(c, probe_timeout_s) for c in clients))
        finally:
            await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)

    return {u: why for u, why in zip(urls, asyncio.run(go()) if urls else []) if why is not None}


def union_failures(layout: Layout, failed: dict[str, str]) -> dict[str, str]:
    """Every rank's {engine url: first error}, merged, on every rank (collective). Without failures
    (the usual case) one one-element all-reduce, not an object all-gather (pickles, several syncs)."""
    if layout.world_size == 1:
        return dict(failed)
    if not any_rank(layout, bool(failed)):
        return {}
    everyone = [None] * layout.world_size
    dist.all_gather_object(everyone, failed)
    union: dict[str, str] = {}
    for f in everyone:
        for url, err in f.items():
            union.setdefault(url, err)
    return union


def any_rank(layout: Layout, flag: bool) -> bool:
    """True on every rank when ``flag`` is true on any (collective)."""
    if layout.world_size == 1:
        return flag
    t = torch.tensor([float(flag)], device=compat.DEVICE)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())
