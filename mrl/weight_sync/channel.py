"""The loop's one view of a weight-update channel, whatever reaches the engines: full weights
(``sync.EngineSync``, any transport) or adapters (``lora.AdapterChannel``, LoRA runs).

    channel.connect()
    report = channel.sync("7")     # collective over the trainer ranks; the engines hold version 7 after it
    channel.add(joining)           # restarted engines: the next sync brings them level
    channel.close()
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

from mrl.sglang.endpoint import EngineEndpoint


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
    """Why each dropped engine was judged dead (``EngineSync.verdict``)."""
    stamped_with_push: list[str] = field(default_factory=list)
    """Engines that took the version with the weights (every bucket in one request, ``PushStats.stamped``)."""
    phase_seconds: dict[str, float] = field(default_factory=dict)
    """Where the sync's seconds went on this rank: ``check`` (finite weights), ``pause`` (pause, flush and
    the verdict on them), ``push``, ``finish`` (stamp, continue and the verdict) and ``barrier``."""


class WeightChannel(abc.ABC):
    """Collective over the trainer ranks: every rank holds one and makes the same calls; rank 0 talks to the
    engines. ``engines`` are those served now, ``dropped`` the urls of those found dead so far."""

    engines: list[EngineEndpoint]
    dropped: list[str]
    adapter: str | None = None
    """The adapter the engines serve the trainer's weights under; None: the engines hold them themselves
    (full weights), or no version was pushed yet (adapters)."""

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
