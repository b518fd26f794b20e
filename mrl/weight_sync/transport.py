"""Weight transports behind one interface, and the sync sequence every transport shares.

    transport = make_transport(WeightTransport.distributed, model=..., layout=..., bridge=..., ...)
    syncer = EngineSync(transport, DiskWeightSync(...), layout)
    syncer.connect()
    report = syncer.sync("7")      # pause -> flush -> push -> repair through disk -> stamp -> continue
    syncer.close()

- ``distributed``: SGLang's ``update_weights_from_distributed``, broadcast from parallel senders
  (``executor.DistributedWeightSync``). The fast path on any cluster.
- ``disk``: safetensors export + ``update_weights_from_disk``. Slow, but it needs nothing beyond a
  shared file system, so it is also how every other transport repairs an engine.
- ``tensor``: colocated engines (same node, same GPUs): each bucket's full tensors travel as CUDA IPC
  handles through ``update_weights_from_tensor``. GPU only: a 0.5.10 server crashes on CPU tensors
  passed between processes, so this transport refuses to start without CUDA.

Every transport's ``push`` is collective over the trainer ranks and never raises for engine-side
failures: they come back in ``PushStats.failed_engines`` and ``EngineSync`` reloads those engines
from disk, so an engine is never left on a partial update.
"""

from __future__ import annotations

import abc
import asyncio
import base64
import contextlib
import io
import os
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler

import torch
import torch.distributed as dist

from mrl.config.schema import WeightTransport
from mrl.megatron.collectives import CollectiveError, named
from mrl.megatron.parallel import Layout
from mrl.megatron.weights import export_hf
from mrl.models.bridge import ModelBridge, split_full
from mrl.models.checkpoint import save_hf
from mrl.rollout.client import EngineClient
from mrl.weight_sync.executor import (DistributedWeightSync, EngineEndpoint, PushStats, _LoopThread,
                                      union_failures)


class Transport(abc.ABC):
    """One way of moving the trainer's weights into the engines. All methods are collective."""

    name: str

    def connect(self) -> None:
        """Set up channels (process groups) once; re-called after an engine restart."""

    @abc.abstractmethod
    def push(self, version: str, engines: list[EngineEndpoint] | None = None) -> PushStats:
        """Move the current weights into ``engines`` (default: all); engines are already paused."""

    def close(self) -> None:
        """Tear the channels down."""


class DistributedTransport(Transport):
    name = "distributed"

    def __init__(self, executor: DistributedWeightSync):
        self.executor = executor

    def connect(self) -> None:
        self.executor.connect()

    def push(self, version: str, engines: list[EngineEndpoint] | None = None) -> PushStats:
        if engines is not None and set(engines) != set(self.executor.engines):
            raise ValueError("the distributed transport pushes to every engine of its groups at once")
        return self.executor.push()

    def close(self) -> None:
        self.executor.close()


class DiskWeightSync(Transport):
    """safetensors export on rank 0 (``export_dir/v<version>``) + ``update_weights_from_disk``.

    ``export_dir`` must be readable by the engines (a shared file system on clusters). Only the
    ``keep`` newest exports are kept."""

    name = "disk"

    def __init__(self, *, model: torch.nn.Module, layout: Layout, bridge: ModelBridge, padded_vocab: int,
                 engines: list[EngineEndpoint], export_dir: str | None, config_src: str, keep: int = 2):
        self.model, self.layout, self.bridge, self.vp = model, layout, bridge, padded_vocab
        self.engines, self.config_src, self.keep = engines, config_src, keep
        self.export_dir = export_dir or tempfile.mkdtemp(prefix="mrl_weights_")
        self.last_path: str | None = None

    def export(self, version: str) -> str | None:
        """Collective: the full HF checkpoint of the current weights on rank 0 (its path there)."""
        tensors = export_hf(self.model, self.layout, self.bridge, self.vp)
        if self.layout.world_rank != 0:
            return None
        path = os.path.join(self.export_dir, f"v{version}")
        save_hf(tensors, path, config_src=self.config_src)
        self.last_path = path
        olds = sorted((d for d in os.listdir(self.export_dir) if d.startswith("v") and d != f"v{version}"),
                      key=lambda d: os.path.getmtime(os.path.join(self.export_dir, d)))
        for d in olds[:max(0, len(olds) - self.keep + 1)]:
            import shutil

            shutil.rmtree(os.path.join(self.export_dir, d), ignore_errors=True)
        return path

    def push(self, version: str, engines: list[EngineEndpoint] | None = None) -> PushStats:
        t0 = time.perf_counter()
        path = self.export(version)
        failed: dict[str, str] = {}
        nbytes = 0
        if self.layout.world_rank == 0:
            nbytes = os.path.getsize(os.path.join(path, "model.safetensors"))
            failed = _run_on(engines or self.engines,
                             lambda c: c.update_weights_from_disk(path, weight_version=version))
        box = [failed]
        dist.broadcast_object_list(box, src=0)
        return PushStats(seconds=time.perf_counter() - t0, bytes_sent=nbytes, buckets_sent=1,
                         failed_engines=box[0])


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """SGLang's ``MultiprocessingSerializer`` format: base64 of a ForkingPickler dump of
    ``[(name, tensor)]`` -- CUDA tensors pickle as IPC handles (torch.multiprocessing's reductions)."""
    cpu = [n for n, t in named if not t.is_cuda]
    if cpu:
        raise ValueError(f"update_weights_from_tensor takes CUDA tensors only (CPU tensors crash a 0.5.10 "
                         f"server): {cpu[:3]}")
    return _dumps(named)


def _dumps(named: list[tuple[str, torch.Tensor]]) -> str:
    import torch.multiprocessing  # noqa: F401  registers torch's tensor reductions with ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf).dump(named)
    return base64.b64encode(buf.getvalue()).decode()


class TensorTransport(Transport):
    """Colocated engines: senders gather each bucket (as the distributed transport does) and post
    it as CUDA IPC handles. No collective with the engines, so any order of requests is safe."""

    name = "tensor"

    def __init__(self, executor: DistributedWeightSync):
        if not torch.cuda.is_available():
            raise RuntimeError("weight_sync.transport=tensor needs CUDA (colocated GPUs): SGLang 0.5.10 crashes "
                               "on CPU tensors sent between processes; use transport=distributed or disk")
        self.executor = executor
        self._io = _LoopThread() if executor.is_sender else None
        self._clients = [EngineClient(e.url) for e in executor.engines] if executor.is_sender else []

    def push(self, version: str, engines: list[EngineEndpoint] | None = None) -> PushStats:
        ex = self.executor
        t0 = time.perf_counter()
        failed: dict[str, str] = {}
        sent = nbytes = 0
        for bucket in ex._order:
            gathered = ex._gather_bucket(bucket)
            if gathered is None:
                continue
            named = [(name, t.contiguous()) for p, pm, full in gathered for name, t in split_full(pm, full).items()]
            payload = serialize_named_tensors(named)  # tensors stay alive until every engine answered
            for url, err in _run_on(ex.engines, lambda c: c.update_weights_from_tensor(
                    [payload] * next(e.tp for e in ex.engines if e.url == c.url)), loop=self._io).items():
                failed.setdefault(url, err)
            sent += 1
            nbytes += sum(t.numel() * t.element_size() for _, t in named)
        return PushStats(seconds=time.perf_counter() - t0, bytes_sent=nbytes, buckets_sent=sent,
                         failed_engines=union_failures(ex.layout, failed))

    def close(self) -> None:
        if self._io is not None:
            self._io.close()


def _run_on(engines: list[EngineEndpoint], call, loop: _LoopThread | None = None) -> dict[str, str]:
    """Run ``call(client)`` on every engine concurrently; {url: error} of those that failed."""

    async def go():
        clients = [EngineClient(e.url) for e in engines]

        async def one(c):
            try:
                await call(c)
                return None
            except Exception as e:  # collected: the caller repairs or reports those engines
                return f"{type(e).__name__}: {e}"
            finally:
                await c.close()

        errs = await asyncio.gather(*(one(c) for c in clients))
        return {e.url: err for e, err in zip(engines, errs) if err is not None}

    if loop is not None:
        return loop.submit(go()).result()
    return asyncio.run(go())


@dataclass
class SyncReport:
    version: str
    transport: str
    seconds: float
    push_seconds: float
    bytes_sent: int
    bytes_in_place: int = 0
    """This rank's bytes broadcast straight from its params (no copy)."""
    failed_engines: dict[str, str] = field(default_factory=dict)
    repaired_from_disk: list[str] = field(default_factory=list)
    dropped_engines: list[str] = field(default_factory=list)
    """Engines found dead during this sync and removed from the weight-update groups."""


class EngineSync:
    """The sequence for one weight version, whatever the transport:
    pause(abort) + flush -> push -> engines that failed are reloaded from disk -> stamp -> continue.

    Partial rollouts survive: requests aborted by the pause come back to the rollout manager, which
    resumes them on the new weights (per-token versions tell the trainer which tokens are stale)."""

    def __init__(self, transport: Transport, disk: DiskWeightSync, layout: Layout,
                 engines: list[EngineEndpoint], *, pause_mode: str = "abort", rebuild=None):
        """``rebuild(engines) -> (transport, disk)``: new channels for the engines still alive after
        one died mid-sync (its weight-update groups are broken for every member); None = fail instead."""
        self.transport, self.disk, self.layout, self.engines = transport, disk, layout, engines
        self.pause_mode, self.rebuild = pause_mode, rebuild
        self.dropped: list[str] = []

    def connect(self) -> None:
        t0 = time.monotonic()
        try:
            self.transport.connect()
        except (RuntimeError, TimeoutError) as e:  # the store's "1/2 clients joined", or a bare future timeout
            raise CollectiveError(f"rank {self.layout.world_rank}: creating the weight-update groups with engines "
                                  f"{[x.url for x in self.engines]} failed after {time.monotonic() - t0:.1f} s "
                                  f"(limit: weight_sync.timeout_s): {type(e).__name__}: {e}") from e

    def close(self) -> None:
        try:
            self.transport.close()
        except TimeoutError as e:  # the controller's wait for the engines' destroy requests: no message of its own
            raise CollectiveError(f"rank {self.layout.world_rank}: engines {[x.url for x in self.engines]} did not "
                                  "answer destroy_weights_update_group within weight_sync.timeout_s") from e

    def sync(self, version: str) -> SyncReport:
        t0 = time.perf_counter()
        controller = self.layout.world_rank == 0
        errs = _run_on(self.engines, self._pause) if controller else {}
        dead = self._dead(errs)  # collective: every rank learns which engines are gone
        if controller and set(errs) - set(dead):
            raise RuntimeError(f"weight sync v{version}: could not pause engines: {errs}")
        if dead:  # died before the sync (mid-rollout): sync the others
            self._drop(dead, version, errs)
        try:
            with _kill_during_sync(version, self.engines, controller):  # fault injection (tests); off by default
                stats = self.transport.push(version)
        except TimeoutError as e:  # the controller's wait for the engines' update requests: no message of its own
            raise CollectiveError(f"weight sync v{version}: engines {[x.url for x in self.engines]} did not answer "
                                  "every bucket request within weight_sync.timeout_s per bucket (one stopped "
                                  "mid-push?)") from e
        if not stats.ok and ((more := self._dead(stats.failed_engines)) or stats.groups_broken):
            # died mid-sync, or a broadcast failed: its groups are broken for every member (the sender tore
            # them down so no engine waits in them); rebuild them without the dead, push again
            self._drop(more, version, stats.failed_engines)
            dead += more
            stats = self.transport.push(version)
        repaired: list[str] = []
        if not stats.ok and self.transport is not self.disk:  # never leave an engine on partial weights
            bad = [e for e in self.engines if e.url in stats.failed_engines]
            fix = self.disk.push(version, bad)
            if not fix.ok:
                raise RuntimeError(f"weight sync v{version}: {stats.failed_engines}; disk repair failed too: "
                                   f"{fix.failed_engines}")
            repaired = [e.url for e in bad]
        elif not stats.ok:
            raise RuntimeError(f"weight sync v{version} over disk failed: {stats.failed_engines}")
        if controller:
            errs = _run_on(self.engines, lambda c: self._finish(c, version))
            if errs:
                raise RuntimeError(f"weight sync v{version}: could not stamp/continue engines: {errs}")
        with named(f"the barrier closing weight sync v{version}"):
            dist.barrier()
        return SyncReport(version=version, transport=self.transport.name, seconds=time.perf_counter() - t0,
                          push_seconds=stats.seconds, bytes_sent=stats.bytes_sent, bytes_in_place=stats.bytes_in_place,
                          failed_engines=stats.failed_engines, repaired_from_disk=repaired, dropped_engines=dead)

    def add(self, new: list[EngineEndpoint]) -> None:
        """Engines joining (restarted ones): new channels with every engine; the next ``sync`` pushes to all
        of them. Collective."""
        if self.rebuild is None:
            raise RuntimeError("EngineSync.add needs a rebuild function")
        self._rechannel(self.engines + list(new))

    def _drop(self, dead: list[str], version: str, why: dict[str, str]) -> None:
        """New channels for the engines still alive (all of them when ``dead`` is empty: broken groups)."""
        if self.rebuild is None or len(dead) == len(self.engines):
            raise RuntimeError(f"weight sync v{version}: " + (f"engines died: {dead}" if dead else
                               "a broadcast failed and its groups cannot be rebuilt") + f" ({why})")
        self.dropped += dead
        self._rechannel([e for e in self.engines if e.url not in dead])

    def _rechannel(self, engines: list[EngineEndpoint]) -> None:
        """Tear the channels down and build them again for ``engines`` (per-run group names: never reused)."""
        self.transport.close()
        self.engines = engines
        self.transport, self.disk = self.rebuild(engines)
        self.connect()

    def _dead(self, failed: dict[str, str]) -> list[str]:
        """Failed engines whose port refuses connections (killed), agreed on by every rank."""
        import socket
        from urllib.parse import urlparse

        dead = []
        if self.layout.world_rank == 0:
            for url in failed:
                u = urlparse(url)
                try:
                    socket.create_connection((u.hostname, u.port), timeout=3).close()
                except OSError:
                    dead.append(url)
        box = [dead]
        with named("broadcast of the engines found dead during a weight sync", src=0):
            dist.broadcast_object_list(box, src=0)
        return box[0]

    async def _pause(self, c: EngineClient) -> None:
        await c.pause(self.pause_mode)
        await c.flush_cache()

    @staticmethod
    async def _finish(c: EngineClient, version: str) -> None:
        await c.update_weight_version(version, abort_all_requests=False)
        await c.resume()


FAULT_KILL_ENGINE_DURING_SYNC = "MRL_FAULT_KILL_ENGINE_DURING_SYNC"
"""Fault injection for tests, off unless set: ``<version>[:<engine>[:<broadcast>]]`` SIGKILLs engine number
``engine`` (of those alive at that sync; default: the last) during the weight sync to ``version``, right
before trainer rank 0's broadcast number ``broadcast`` (default 0) of the push: the engines are paused and
flushed, the buckets before it are on them, every update request is posted. Only engines on this host
(started by this process, or listening on the URL's port). docs/reliability.md lists what it showed."""


@contextlib.contextmanager
def _kill_during_sync(version: str, engines: list[EngineEndpoint], controller: bool):
    spec = os.environ.get(FAULT_KILL_ENGINE_DURING_SYNC, "")
    want, _, rest = spec.partition(":")
    if not controller or want != version:
        yield
        return
    idx, _, nth = rest.partition(":")
    victim, at = engines[int(idx) if idx else -1].url, int(nth or 0)
    real, seen = dist.broadcast, [0]

    def broadcast(*args, **kwargs):  # the push's broadcasts, counted on the rank that injects the fault
        if seen[0] == at:
            print(f"[mrl] fault injection ({FAULT_KILL_ENGINE_DURING_SYNC}={spec}): SIGKILL engine {victim} "
                  f"before broadcast {at} of weight sync v{version}", flush=True)
            _kill_engine(victim)
        seen[0] += 1
        return real(*args, **kwargs)

    dist.broadcast = broadcast  # test-only: patched for this one push, restored below
    try:
        yield
    finally:
        dist.broadcast = real
    if seen[0] <= at:
        raise RuntimeError(f"{FAULT_KILL_ENGINE_DURING_SYNC}={spec}: the push of v{version} made only "
                           f"{seen[0]} broadcasts on this rank, so no engine was killed")


def _kill_engine(url: str) -> None:
    """SIGKILL the engine serving ``url`` (its whole process group when this process started it) and wait
    until its port refuses connections."""
    import signal
    import socket
    from urllib.parse import urlparse

    import psutil

    from mrl.rollout.engine import _LIVE

    u = urlparse(url)
    mine = [e for e in list(_LIVE) if e.url.rstrip("/") == url.rstrip("/") and e.alive()]
    if mine:
        os.killpg(mine[0].proc.pid, signal.SIGKILL)
    else:
        pids = {c.pid for c in psutil.net_connections("tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr.port == u.port and c.pid}
        if not pids:
            raise RuntimeError(f"{FAULT_KILL_ENGINE_DURING_SYNC}: no process listens on {url}")
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            socket.create_connection((u.hostname, u.port), timeout=1).close()
        except OSError:
            return
        time.sleep(0.05)
    raise RuntimeError(f"{FAULT_KILL_ENGINE_DURING_SYNC}: {url} still accepts connections 30 s after SIGKILL")


def make_transport(kind: WeightTransport, *, model: torch.nn.Module, layout: Layout, bridge: ModelBridge,
                   padded_vocab: int, engines: list[EngineEndpoint], bucket_bytes: int, export_dir: str | None,
                   config_src: str, dtype: str = "float32", timeout_s: float = 300.0,
                   group_prefix: str = "mrl", **executor_kw) -> tuple[Transport, DiskWeightSync]:
    """The configured transport and the disk transport that repairs it (the same object for disk)."""
    disk = DiskWeightSync(model=model, layout=layout, bridge=bridge, padded_vocab=padded_vocab, engines=engines,
                          export_dir=export_dir, config_src=config_src)
    if kind == WeightTransport.disk:
        return disk, disk
    ex = DistributedWeightSync(model=model, layout=layout, bridge=bridge, padded_vocab=padded_vocab,
                               engines=engines, bucket_bytes=bucket_bytes, dtype=dtype, timeout_s=timeout_s,
                               group_prefix=group_prefix, **executor_kw)
    if kind == WeightTransport.tensor:
        return TensorTransport(ex), disk
    return DistributedTransport(ex), disk
