"""Rollout buffer between generation (controller thread) and training (trainer main thread).

Groups go in when complete and scored; the trainer takes whole groups. A group is admitted to a
batch only if its oldest token's weight version is within ``max_staleness`` of the trainer's version;
older groups are dropped (counted) or kept for the off-policy correction, per ``train.stale_policy``.
Producers are throttled by credits: every group taken or dropped returns one credit, so groups in
flight + buffered never exceed the configured bound (async mode), or exactly one batch (sync mode).
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from dataclasses import dataclass, field

from mrl.data import Prompt
from mrl.rollout.sample import Sample


@dataclass
class Group:
    prompt: Prompt
    samples: list[Sample]
    rewards: list[float]
    texts: list[str] = field(default_factory=list)
    token_rewards: list[list[float]] | None = None
    """Per sample, per response token, when a scorer gives them (``mrl.scoring``); None otherwise."""

    @property
    def oldest_version(self) -> int:
        return min((min(s.versions) for s in self.samples if s.versions), default=0)


@dataclass
class BufferStats:
    put: int = 0
    taken: int = 0
    dropped_stale: int = 0
    staleness: Counter = field(default_factory=Counter)
    """Histogram over trained samples: versions between the trainer and each sample's oldest token."""


class RolloutBuffer:
    def __init__(self, *, max_staleness: int, drop_stale: bool):
        self.max_staleness, self.drop_stale = max_staleness, drop_stale
        self._groups: deque[Group] = deque()
        self._cv = threading.Condition()
        self.stats = BufferStats()
        self.on_release = lambda n: None
        """Called with the number of groups taken or dropped: the producer's credits."""

    def put(self, group: Group) -> None:
        with self._cv:
            self._groups.append(group)
            self.stats.put += 1
            self._cv.notify_all()

    def __len__(self) -> int:
        with self._cv:
            return len(self._groups)

    def take(self, n: int, version: int, timeout: float = 600.0, check=lambda: None) -> list[Group]:
        """Block until ``n`` admissible groups are there; drops stale ones on the way (counted).
        ``check()`` runs every second while waiting (it raises when the producer died)."""
        out: list[Group] = []
        with self._cv:
            while len(out) < n:
                waited = 0.0
                while not self._groups:
                    check()
                    if waited >= timeout:
                        raise TimeoutError(f"rollout buffer: no group arrived in {timeout:.0f} s "
                                           f"({len(out)}/{n} of a batch; are the engines alive?)")
                    self._cv.wait(1.0)
                    waited += 1.0
                released = 0
                while self._groups and len(out) < n:
                    g = self._groups.popleft()
                    released += 1
                    lag = version - g.oldest_version
                    if lag > self.max_staleness and self.drop_stale:
                        self.stats.dropped_stale += 1
                        continue
                    out.append(g)
                    for s in g.samples:
                        self.stats.staleness[version - min(s.versions, default=version)] += 1
                if released:
                    self.on_release(released)
        self.stats.taken += len(out)
        return out

    def state(self) -> list[Group]:
        with self._cv:
            return list(self._groups)

    def restore(self, groups: list[Group]) -> None:
        with self._cv:
            self._groups.extend(groups)
