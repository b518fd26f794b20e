"""Python's garbage collector in the trainer processes (``train.gc_freeze``, ``train.gc_interval``).

A full collection walks every tracked object, and after megatron, torch and transformers are imported
and the model built that is a heap of millions: a pause of a large fraction of a second, at a moment of
Python's choosing, different on every rank. On a step bound by collectives (the expert all-to-all waits
for its slowest peer) one rank's pause is everyone's. Freezing the setup heap leaves later collections
only what the steps allocate; with an interval, collections happen between steps, on all ranks at once.
"""

from __future__ import annotations

import gc


class StepCollector:
    def __init__(self, *, freeze: bool, interval: int):
        self.freeze, self.interval = freeze, interval  # validated by TrainConfig
        self.steps = 0

    def after_setup(self) -> None:
        """Once the model and optimizer exist: collect, freeze what survives, take over scheduling."""
        if self.freeze:
            gc.collect()
            gc.freeze()
        if self.interval > 0:
            gc.disable()

    def after_step(self) -> None:
        """After every optimizer step (taken or skipped), on every rank: every ``interval``-th collects."""
        self.steps += 1
        if self.interval > 0 and self.steps % self.interval == 0:
            gc.collect()
