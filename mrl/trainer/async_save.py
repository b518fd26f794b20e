"""Asynchronous checkpoints (``train.async_save``): megatron's dist_checkpointing stages each rank's shards
to host memory when the save is scheduled and writes them from a forked process while training goes on.
A checkpoint is completed, in order, once every rank's writer is done (checked collectively after each
step): megatron's finalizers write its metadata, then ``complete`` writes mrl's loop state, the marker a
resume looks for. A save that never completes (the run dies, or is aborted) leaves no marker: a resume
takes the newest complete checkpoint before it.

    saves = AsyncCheckpoints(complete=lambda path, state: ...)
    saves.schedule(policy.save(path, async_save=True), path, state)   # every rank
    saves.finalize(blocking=False)                                     # every rank, after each step
    saves.finalize(blocking=True)                                      # before the next save, at the end
"""

from __future__ import annotations

import time
from typing import Callable

from mrl.trainer.state import LoopState


class AsyncCheckpoints:
    def __init__(self, complete: Callable[[str, LoopState], None]):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        # a writer process per save (megatron's temporal caller): nothing stays alive between saves
        self.queue = AsyncCallsQueue(persistent=False)
        self.complete = complete
        self.pending: dict[int, tuple[str, LoopState, float]] = {}

    def schedule(self, request, path: str, state: LoopState, began: float | None = None) -> None:
        """Start writing ``request`` (``Policy.save(..., async_save=True)``), which completes checkpoint
        ``path`` with ``state``; ``began``: when the save began (``time.perf_counter``; default now), what
        ``finalize`` counts its seconds from. Collective; stages this rank's tensors to host memory before
        it returns."""
        idx = self.queue.schedule_async_request(request)
        self.pending[idx] = (path, state, time.perf_counter() if began is None else began)

    def finalize(self, *, blocking: bool) -> list[tuple[str, float]]:
        """Complete, oldest first, every save whose writers are done on every rank (all of them when
        ``blocking``); the completed paths with their seconds since the save began. Collective: every rank
        calls it at the same point, with the same saves pending (they are scheduled together)."""
        if not self.pending:
            return []
        done = []
        for idx in self.queue.maybe_finalize_async_calls(blocking=blocking):
            path, state, t0 = self.pending.pop(idx)
            self.complete(path, state)
            done.append((path, time.perf_counter() - t0))
        return done

    def abort(self) -> None:
        """Stop the writers of saves not completed (the run is failing): their checkpoints stay unmarked."""
        if self.pending:
            self.queue.close(abort=True)
            self.pending.clear()
