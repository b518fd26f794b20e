"""Where a run's time to its first step goes: seconds from ``mrl train``'s start to each start phase.

``mrl train`` stamps its start in the environment (``MRL_LAUNCHED_AT``, wall clock: the trainer ranks are
other processes, started by torchrun, and on Slurm other hosts whose clocks NTP keeps within milliseconds);
rank 0 marks each phase as it ends, and the first step's metrics row carries them (``startup/<phase>_s``).
A process started without ``mrl train`` (a test's torchrun) counts from its own start.
"""

from __future__ import annotations

import os
import time

LAUNCHED_AT = "MRL_LAUNCHED_AT"

PHASES = ("trainer_imported", "parallel_ready", "policy_ready", "warm_started", "engines_healthy",
          "rollout_started", "weights_connected", "generation_started", "first_batch", "first_step")
"""In the order they end: rank 0 has imported torch, megatron and mrl's trainer; megatron's groups are
built; the model is built with its HF weights (or a checkpoint's); the supervised warm start is done
(``train.sft_warmup_steps``); the engines answer /health (they boot while the trainer builds and warms
up); the rollout process runs; the weight channels are connected; generation starts; the first batch is
in; the first step (train and sync) is done."""


def stamp_launch() -> None:
    """``mrl train``, first thing: the moment every later phase counts from (kept if already set, so a
    launcher above us, e.g. ``mrl launch``, counts from its own start)."""
    os.environ.setdefault(LAUNCHED_AT, repr(time.time()))


class StartupClock:
    """Seconds since the launch at which each phase ended; a phase marked twice keeps its first time."""

    def __init__(self) -> None:
        raw = os.environ.get(LAUNCHED_AT)
        self.t0 = float(raw) if raw else time.time()
        self.marks: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown start phase {phase!r}; one of {PHASES}")
        self.marks.setdefault(phase, time.time() - self.t0)

    def metrics(self) -> dict[str, float]:
        return {f"startup/{p}_s": self.marks[p] for p in PHASES if p in self.marks}

    def summary(self) -> str:
        """One console line: the first step's time and what the trainer and the engines took of it."""
        m = self.marks
        parts = [f"{name} {m[p]:.0f} s" for name, p in (("trainer ready", "policy_ready"),
                                                         ("engines healthy", "engines_healthy"),
                                                         ("first batch", "first_batch")) if p in m]
        return f"first step done {m.get('first_step', float('nan')):.0f} s after launch ({', '.join(parts)})"
