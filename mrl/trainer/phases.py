"""Where a step's time goes: named phases that add up to the step's wall time.

    phases = StepPhases()                      # the first step's window opens as the loop starts
    with phases.timed("wait"):
        batch = take_batch()
    ...
    m |= phases.close()                        # {"wait_seconds": .., "other_seconds": .., "step_seconds": ..}
    with phases.timed("log"):                  # counted in the next step's row
        log_step(m)

A step's window runs from the close of the previous step's row to the close of its own, so the windows
tile the loop: ``step_seconds`` of all rows sum to the loop's wall time. A row is closed before its own
logging, evaluation and checkpoint, so those are in the next row. ``other`` is what no phase timed
(bookkeeping, the broadcast of joining engines): ``PHASES`` plus ``other`` sum to ``step_seconds``.
A phase that did not run in a window (no sync this step) has no key in its row.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator

PHASES = ("wait", "routing", "train", "drain", "sync", "verify", "log", "eval", "checkpoint")
"""wait: for the step's batch (the rollout side, the batch's delivery to every rank); routing: the routing
diagnostics' forward pass (``train.routing_metrics_every``); train: the RL step; drain: pausing and
resuming generation around a weight sync; sync: the weight push; verify: the engines' probe after it
(``weight_sync.verify``); log: metrics, trackers and the console; eval: submitting an evaluation
(``train.eval_every``) and reporting the finished ones, not their generation, which runs beside training;
checkpoint: saving, or completing an asynchronous save."""


class StepPhases:
    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.opened = clock()
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        if phase not in PHASES:
            raise ValueError(f"unknown step phase {phase!r}; one of {PHASES}")
        t0 = self.clock()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + self.clock() - t0

    def close(self) -> dict[str, float]:
        """This window's phases, ``other_seconds`` and ``step_seconds``; the next window opens now."""
        now = self.clock()
        step = now - self.opened
        out = {f"{p}_seconds": s for p, s in self.seconds.items()}
        out |= {"other_seconds": step - sum(self.seconds.values()), "step_seconds": step}
        self.opened, self.seconds = now, {}
        return out
