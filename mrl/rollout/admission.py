"""Admission of generation calls to one engine: at most ``limit`` in flight, and calls that had to wait are
let in together rather than one per freed slot.

An engine kept full lets a new sample in each time one finishes. With GRPO's unequal response lengths
samples finish one or two at a time, so the engine runs a prefill forward for every one or two arrivals
(SGLang does not mix prefills into its decode batches by default), each pausing the decode of the whole
batch; those small prefills are launch-bound and can cost more of a run than the decode itself. Letting the
waiting calls in once ``quantum`` slots are free makes one larger prefill of them instead.
"""

from __future__ import annotations

import asyncio
from collections import deque


class AdmissionGate:
    """``async with gate:`` holds one of ``limit`` slots. The gate is open until the engine is full (every
    slot taken): while open, a call finding a free slot and nobody waiting enters at once, so a run's first
    wave goes in together. Once full, calls wait, and are let in together, oldest first and as many as there
    are free slots, once ``quantum`` slots are free or once the oldest has waited ``max_wait_s`` (an engine
    whose samples finish slowly is not left short of work); slots still free after that leave the gate open
    again, as does an idle engine. ``quantum`` 1 is a plain semaphore."""

    def __init__(self, limit: int, quantum: int = 1, max_wait_s: float = 0.5):
        if limit < 1:
            raise ValueError(f"AdmissionGate: limit must be >= 1, got {limit}")
        if not 1 <= quantum <= limit:
            raise ValueError(f"AdmissionGate: quantum must be in [1, limit={limit}], got {quantum}")
        if max_wait_s < 0:
            raise ValueError(f"AdmissionGate: max_wait_s must be >= 0, got {max_wait_s}")
        self.limit, self.quantum, self.max_wait_s = limit, quantum, max_wait_s
        self.in_use = 0
        self.admissions = 0
        """Times waiting calls were let in (together): each is one arrival burst at the engine."""
        self._waiters: deque[tuple[asyncio.Future, float]] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self._open = True

    async def __aenter__(self) -> "AdmissionGate":
        if self.in_use == 0:
            self._open = True
        if self._open and not self._waiters and self.in_use < self.limit:
            self.in_use += 1
            self._open = self.in_use < self.limit
            return self
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._waiters.append((fut, loop.time()))
        self._admit()
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # let in, then cancelled before it could use the slot
                self._release()
            else:
                self._waiters = deque(w for w in self._waiters if w[0] is not fut)
                self._admit()  # the calls behind it may fit now
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        self._release()

    def _release(self) -> None:
        self.in_use -= 1
        if self.in_use == 0:
            self._open = True
        self._admit()

    def _admit(self) -> None:
        while self._waiters and self._waiters[0][0].done():  # cancelled while waiting
            self._waiters.popleft()
        free = self.limit - self.in_use
        if not self._waiters or free <= 0:
            return
        loop = asyncio.get_running_loop()
        waited = loop.time() - self._waiters[0][1]
        if self._open or free >= self.quantum or waited >= self.max_wait_s or self.in_use == 0:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self.admissions += 1
            while self._waiters and self.in_use < self.limit:
                fut, _ = self._waiters.popleft()
                if not fut.done():
                    self.in_use += 1
                    fut.set_result(None)
            self._open = self.in_use < self.limit
        elif self._timer is None:  # nothing else may come to free a slot: the oldest's wait ends it
            self._timer = loop.call_later(self.max_wait_s - waited, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._admit()
