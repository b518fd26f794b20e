"""The full-weight channel: the sequence every transport shares for one weight version.

    transport, disk = make_transport(WeightTransport.distributed, model=..., layout=..., bridge=..., ...)
    channel = FullWeightChannel(transport, disk, layout, engines, rebuild=...)
    channel.connect()
    report = channel.sync("7")     # pause (-> flush) -> push -> repair through disk -> stamp -> continue
    channel.close()
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from mrl.megatron.collectives import CollectiveError, named
from mrl.megatron.parallel import Layout
from mrl.sglang.client import PAUSE_MODES, EngineClient, close_clients
from mrl.sglang.endpoint import EngineEndpoint
from mrl.weight_sync.channel import SyncReport, WeightChannel
from mrl.weight_sync.checks import check_finite_weights
from mrl.weight_sync.transport import LoopThread, Transport, run_on

SYNC_MODES = (*PAUSE_MODES, "staged")
"""``weight_sync.pause_mode``: SGLang's pause modes, and ``staged`` (no pause: the engines load the push while they
generate and swap it in between two forward passes, ``mrl.engine.server.staged``)."""


class _Phases:
    """Seconds between consecutive ``mark`` calls, by the name of the phase each call closes."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._t = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._t
        self._t = now


class FullWeightChannel(WeightChannel):
    """The sequence for one weight version, whatever the transport:
    pause (``pause_mode``; abort: + flush) -> push -> engines that failed are reloaded from disk -> stamp -> continue.
    ``staged`` pauses nothing: the engines load the push (and a repair) while they generate, and ``continue`` swaps
    it in between two forward passes.

    Partial rollouts survive: requests aborted by the pause come back to the rollout manager, which
    resumes them on the new weights (per-token versions tell the trainer which tokens are stale). A retract or
    in-place pause keeps them in the engines instead, with no flush (SGLang refuses one while it holds requests);
    they continue on the new weights from the next forward pass (``mrl.engine.server.inflight``).

    An engine that fails a step is dropped when it is dead (``verdict``); every control call to the
    engines runs under the liveness watch (``WeightChannel.watch``)."""

    pauses_engines = True

    def __init__(self, transport: Transport, disk: Transport, layout: Layout,
                 engines: list[EngineEndpoint], *, pause_mode: str = "abort", rebuild=None,
                 model: torch.nn.Module | None = None, probe_timeout_s: float = 15.0):
        """``pause_mode``: ``weight_sync.pause_mode`` (abort, retract, in_place, staged).
        ``rebuild(engines) -> (transport, disk)``: new channels for the engines still alive after
        one died mid-sync (its weight-update groups are broken for every member); None = fail instead.
        ``model``: checked for non-finite weights before every sync (``check_finite_weights``).
        ``probe_timeout_s``: ``weight_sync.probe_timeout_s``, the liveness probe's limit."""
        super().__init__(layout, engines, probe_timeout_s=probe_timeout_s)
        self.rebuild, self.model = rebuild, model
        self.transport, self.disk = transport, disk
        self.pause_mode = pause_mode
        # controller: the pause/stamp/continue clients and their loop, kept from one sync to the next (no new
        # event loop, session and connection per call; connections live as long as keep-alive allows)
        self._io: LoopThread | None = None
        self._clients: dict[str, EngineClient] = {}

    def connect(self) -> None:
        t0 = time.monotonic()
        try:
            self.transport.connect()
        except (RuntimeError, TimeoutError) as e:  # the store's "1/2 clients joined", or a bare future timeout
            raise CollectiveError(f"rank {self.layout.world_rank}: creating the weight-update groups with engines "
                                  f"{[x.url for x in self.engines]} failed after {time.monotonic() - t0:.1f} s "
                                  f"(limit: weight_sync.timeout_s): {type(e).__name__}: {e}") from e

    def _on_engines(self, call) -> dict[str, str]:
        """``call(client)`` on every engine at once over the kept clients; {url: error}."""
        if self._io is None:
            self._io = LoopThread()
        gone = [self._clients.pop(u) for u in list(self._clients) if u not in {e.url for e in self.engines}]
        if gone:
            self._io.submit(close_clients(gone)).result(30)
        for e in self.engines:
            self._clients.setdefault(e.url, EngineClient(e))
        return run_on(self.engines, call, loop=self._io, clients=self._clients)

    def close(self) -> None:
        if self._io is not None:
            self._io.submit(close_clients(list(self._clients.values()))).result(30)
            self._io.close()
            self._io, self._clients = None, {}
        try:
            self.transport.close()
        except TimeoutError as e:  # the controller's wait for the engines' destroy requests: no message of its own
            raise CollectiveError(f"rank {self.layout.world_rank}: engines {[x.url for x in self.engines]} did not "
                                  "answer destroy_weights_update_group within weight_sync.timeout_s") from e

    def sync(self, version: str) -> SyncReport:
        t0 = time.perf_counter()
        phases = _Phases()
        if self.model is not None:  # before the engines pause: a refused sync leaves them serving the last weights
            check_finite_weights(self.model, f"weight sync v{version}")
        phases.mark("check")
        controller = self.layout.world_rank == 0
        errs = self._on_engines(self._pause) if controller and self.pause_mode != "staged" else {}
        reasons = self.verdict(errs)  # collective: every rank learns which engines are gone
        dead = list(reasons)
        if controller and set(errs) - set(dead):
            raise RuntimeError(f"weight sync v{version}: could not pause engines (they answer a liveness probe, "
                               f"so they were not dropped): { {u: e for u, e in errs.items() if u not in dead} }")
        if dead:  # died or hung before the sync (mid-rollout): sync the others
            self._drop(reasons, version)
        phases.mark("pause")
        try:
            stats = self.transport.push(version)
        except TimeoutError as e:  # the controller's wait for the engines' update requests: no message of its own
            raise CollectiveError(f"weight sync v{version}: engines {[x.url for x in self.engines]} did not answer "
                                  "every bucket request within weight_sync.timeout_s per bucket (one stopped "
                                  "mid-push?)") from e
        if not stats.ok and ((more := self.verdict(stats.failed_engines)) or stats.groups_broken):
            # died mid-sync, or a broadcast failed: its groups are broken for every member (the sender tore
            # them down so no engine waits in them); rebuild them without the dead, push again
            self._drop(more, version)
            dead += list(more)
            reasons |= more
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
        stamped = set(stats.stamped) - set(repaired)
        phases.mark("push")
        errs = self._on_engines(lambda c: self._finish(c, version, c.url in stamped)) if controller else {}
        late = self.verdict(errs)  # hung after the push: the others hold the weights and go on
        if controller and set(errs) - set(late):
            raise RuntimeError(f"weight sync v{version}: could not stamp/continue engines: "
                               f"{ {u: e for u, e in errs.items() if u not in late} }")
        if late:
            self._drop(late, version)
            dead += list(late)
            reasons |= late
        phases.mark("finish")
        with named(f"the barrier closing weight sync v{version}"):
            dist.barrier()
        phases.mark("barrier")
        return SyncReport(version=version, transport=self.transport.name, seconds=time.perf_counter() - t0,
                          push_seconds=stats.seconds, bytes_sent=stats.bytes_sent, bytes_in_place=stats.bytes_in_place,
                          failed_engines=stats.failed_engines, repaired_from_disk=repaired, dropped_engines=dead,
                          dead_reasons=reasons, stamped_with_push=sorted(stamped), phase_seconds=phases.seconds)

    def add(self, new: list[EngineEndpoint]) -> None:
        """Engines joining (restarted ones): new channels with every engine; the next ``sync`` pushes to all
        of them. Collective."""
        if self.rebuild is None:
            raise RuntimeError("FullWeightChannel.add needs a rebuild function")
        self._rechannel(self.engines + list(new))

    def _drop(self, dead: dict[str, str], version: str) -> None:
        """New channels for the engines still alive (all of them when ``dead`` is empty: broken groups)."""
        if self.rebuild is None or len(dead) == len(self.engines):
            raise RuntimeError(f"weight sync v{version}: " + (f"engines died or hung: {list(dead)}" if dead else
                               "a broadcast failed and its groups cannot be rebuilt") + f" ({dead})")
        self.say_dropped(dead, f"weight sync v{version}")
        self.forget_dead(dead)
        self.transport.forget(list(dead))  # no teardown requests to them: a hung engine would hold each to its limit
        self._rechannel(self.engines)

    def _rechannel(self, engines: list[EngineEndpoint]) -> None:
        """Tear the channels down and build them again for ``engines`` (per-run group names: never reused)."""
        self.transport.close()
        self.engines = engines
        self._use(*self.rebuild(engines))
        self.connect()

    def _use(self, transport: Transport, disk: Transport | None) -> None:
        self.transport, self.disk = transport, disk
        self.pause_mode = self.pause_mode

    @property
    def pause_mode(self) -> str:
        return self._pause_mode

    @pause_mode.setter
    def pause_mode(self, mode: str) -> None:
        """Also tells the transports whether their pushes are staged (a benchmark switches modes between syncs)."""
        if mode not in SYNC_MODES:
            raise ValueError(f"pause_mode must be one of {SYNC_MODES}, got {mode!r}")
        self._pause_mode = mode
        for t in (self.transport, self.disk):
            if t is not None:
                t.staged = mode == "staged"

    async def _pause(self, c: EngineClient) -> None:
        await self.watch(c, c.pause(self.pause_mode), "/pause_generation")
        if self.pause_mode == "abort":  # the others keep requests, and their engines evict what no request holds
            await self.watch(c, c.flush_cache(), "/flush_cache")

    async def _finish(self, c: EngineClient, version: str, stamped: bool = False) -> None:
        if not stamped:  # else the push's own request set it
            await self.watch(c, c.update_weight_version(version, abort_all_requests=False), "/update_weight_version")
        await self.watch(c, c.resume(), "/continue_generation")  # staged: the swap, between two forward passes
