"""The loop's one view of a weight-update channel, whatever reaches the engines: full weights
(``full.FullWeightChannel``, any transport) or adapters (``adapter.AdapterChannel``, LoRA runs).

    channel.connect()
    report = channel.sync("7")     # collective over the trainer ranks; the engines hold version 7 after it
    channel.add(joining)           # restarted engines: the next sync brings them level
    channel.close()

What both channels do alike is written here once: the liveness watch on a call to an engine, the judgement of
which failed engines are dead (on rank 0, and the verdict every rank agrees on), and dropping them.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import torch.distributed as dist

from mrl.log import get_logger
from mrl.megatron.collectives import named
from mrl.megatron.parallel import Layout
from mrl.sglang.client import EngineClient, watched
from mrl.sglang.endpoint import EngineEndpoint
from mrl.sglang.protocol import EngineHung
from mrl.weight_sync.transport import dead_engines

log = get_logger(__name__)


@dataclass
class SyncReport:
    version: str
    transport: str
    seconds: float
    push_seconds: float
    bytes_sent: int
    bytes_in_place: int | None = 0
    """This rank's bytes broadcast straight from its params (no copy); None where nothing is streamed from
    them (adapters)."""
    failed_engines: dict[str, str] = field(default_factory=dict)
    repaired_from_disk: list[str] = field(default_factory=list)
    dropped_engines: list[str] = field(default_factory=list)
    """Engines found dead during this sync and removed from the weight-update groups."""
    dead_reasons: dict[str, str] = field(default_factory=dict)
    """Why each dropped engine was judged dead (``WeightChannel.verdict``)."""
    stamped_with_push: list[str] = field(default_factory=list)
    """Engines that took the version with the weights (every bucket in one request, ``PushStats.stamped``)."""
    phase_seconds: dict[str, float] = field(default_factory=dict)
    """Where the sync's seconds went on this rank: ``check`` (finite weights), ``pause`` (pause, flush and
    the verdict on them), ``push``, ``finish`` (stamp, continue and the verdict) and ``barrier``."""


class WeightChannel(abc.ABC):
    """Collective over the trainer ranks: every rank holds one and makes the same calls; rank 0 talks to the
    engines. ``engines`` are those served now, ``dropped`` the urls of those found dead so far.

    An engine that fails a call is dropped when it is dead: killed, or hung -- a stopped or wedged server
    still accepts connections, so only a liveness probe with its own limit tells (``judge``). A call made
    through ``watch`` is probed meanwhile when it does not return at once (``client.watched``), so a hung
    engine costs about ``probe_timeout_s``, not the call's limit."""

    adapter: str | None = None
    """The adapter the engines serve the trainer's weights under; None: the engines hold them themselves
    (full weights), or no version was pushed yet (adapters)."""

    def __init__(self, layout: Layout, engines: list[EngineEndpoint], *, probe_timeout_s: float = 15.0):
        """``probe_timeout_s``: ``weight_sync.probe_timeout_s``, the liveness probe's limit."""
        self.layout, self.engines, self.probe_timeout_s = layout, list(engines), probe_timeout_s
        self.dropped: list[str] = []
        self._hung: dict[str, str] = {}  # rank 0: engines a watched call already found hung, and why

    @property
    @abc.abstractmethod
    def pauses_engines(self) -> bool:
        """The engines stop generating during a sync: the loop drains the rollout side around it."""

    @abc.abstractmethod
    def connect(self) -> None:
        """Set up what the pushes need (weight-update groups), once."""

    @abc.abstractmethod
    def sync(self, version: str) -> SyncReport:
        """The trainer's weights to every engine as ``version``; dead engines are dropped on the way."""

    @abc.abstractmethod
    def add(self, new: list[EngineEndpoint]) -> None:
        """Engines joining (restarted ones): the next ``sync`` brings them level before they serve."""

    @abc.abstractmethod
    def close(self) -> None:
        """Tear down what ``connect`` set up."""

    def judge(self, failed: dict[str, str]) -> dict[str, str]:
        """Rank 0: of the engines in ``failed`` ({url: error}), those that are dead, with why: hung in a watched
        call already, or failing a liveness probe now (``client.liveness``: refused, no answer within
        ``probe_timeout_s``, or 5xx to every probe). Engines that answer are alive: their failure is an error
        of its own."""
        dead = {u: self._hung[u] for u in failed if u in self._hung}
        dead |= dead_engines([u for u in failed if u not in dead], self.probe_timeout_s)
        self._hung.clear()
        return dead

    def verdict(self, failed: dict[str, str]) -> dict[str, str]:
        """``judge`` on rank 0 (``failed``: its {url: error}); collective: every rank gets rank 0's verdict."""
        dead = self.judge(failed) if self.layout.world_rank == 0 and failed else {}
        self._hung.clear()
        if dist.get_world_size() == 1:  # no other rank to tell
            return dead
        box = [dead]
        with named("broadcast of the engines found dead during a weight sync", src=0):
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def say_dropped(self, dead: dict[str, str], what: str) -> None:
        """Each engine dropped during ``what`` (``weight sync v7``), and why (shown on rank 0)."""
        for url, why in dead.items():
            log.warning("%s: engine %s dropped: %s", what, url, why)

    def forget_dead(self, dead: dict[str, str]) -> None:
        """Engines found dead leave ``engines`` for ``dropped``."""
        self.dropped += list(dead)
        self.engines = [e for e in self.engines if e.url not in dead]

    async def watch(self, c: EngineClient, call, endpoint: str):
        """``call`` on engine ``c``, probed meanwhile when slow; a hung engine is remembered for ``judge``."""
        try:
            return await watched(c, call, endpoint, probe_timeout_s=self.probe_timeout_s)
        except EngineHung as e:
            self._hung[c.url] = str(e)
            raise
