"""A step's logged phases add up to its wall time (``mrl.trainer.phases``), on the loop's own ``run``: the
model, the engines and the rank's collectives are stubs that take known times, so every part of the step
is seen in its phase and ``other`` holds only what no phase covers."""

from __future__ import annotations

import time
import types

import pytest

from mrl.trainer.phases import PHASES, StepPhases

NAP = {"wait": 0.03, "routing": 0.04, "train": 0.05, "drain": 0.03, "sync": 0.03, "verify": 0.03, "log": 0.03,
       "eval": 0.03, "checkpoint": 0.03}
UNTIMED = 0.03  # the controller's bookkeeping after a sync: in no phase


def test_a_window_tiles_the_loop():
    ticks = iter([0.0, 1.0, 3.0, 3.5, 4.0, 4.0, 6.0])
    p = StepPhases(clock=lambda: next(ticks))  # opened at 0
    with p.timed("wait"):  # 1 .. 3
        pass
    with p.timed("train"):  # 3.5 .. 4
        pass
    assert p.close() == {"wait_seconds": 2.0, "train_seconds": 0.5, "other_seconds": 1.5, "step_seconds": 4.0}
    assert p.close() == {"other_seconds": 2.0, "step_seconds": 2.0}  # the next window opened at 4
    with pytest.raises(ValueError, match="unknown step phase"):
        with p.timed("lunch"):
            pass


class _Duties:
    """Rank 0's side, each call taking its phase's time; ``after_sync``'s time is in no phase."""

    def __init__(self):
        self.rows, self.logged_at = [], []

    def drain(self):
        time.sleep(NAP["drain"] / 2)
        return 0

    def undrain(self):
        time.sleep(NAP["drain"] / 2)

    def after_sync(self, alive, joining, dropped):
        time.sleep(UNTIMED)
        return {}

    def log_step(self, step, m, wall):
        self.rows.append(m)
        time.sleep(NAP["log"])

    def maybe_evaluate(self, step, version):
        time.sleep(NAP["eval"])

    def close(self):
        pass


class _Policy:
    lora = None
    version = types.SimpleNamespace(synced=lambda v: None)

    def routing_metrics(self, batch):
        time.sleep(NAP["routing"])
        return {"routing_disagreement": 0.0}

    def rl_step(self, batch, normalizer):
        time.sleep(NAP["train"])
        return {"loss": 0.0}


class _Channel:
    pauses_engines, engines, dropped = True, [], []

    def sync(self, version):
        time.sleep(NAP["sync"])
        return types.SimpleNamespace(dropped_engines=[], bytes_sent=0, bytes_in_place=None, phase_seconds={},
                                     repaired_from_disk=[])

    def close(self):
        pass


def test_the_phases_of_each_step_sum_to_its_wall_time(tmp_path):
    from mrl.config.load import compose
    from mrl.startup import StartupClock
    from mrl.trainer.loop import Loop, NonFiniteSteps

    steps = 4
    cfg = compose([f"run_dir={tmp_path}", f"train.steps={steps}", "train.routing_metrics_every=1",
                   "weight_sync.every_n_steps=2", "engine.max_restarts=0", "train.save_hf=false"])
    loop = Loop.__new__(Loop)  # no model, no process group: the parts of the step are stubs
    loop.cfg, loop.clock, loop.step, loop.version, loop.saves = cfg, StartupClock(), 0, 0, None
    loop.policy, loop.duties, loop.syncer, loop.nonfinite = _Policy(), _Duties(), _Channel(), NonFiniteSteps(0)
    loop.warm_start = loop.connect_engines = lambda: None
    loop.take_batch = lambda: (time.sleep(NAP["wait"]), 1.0, {})
    loop.verify_engines = lambda: time.sleep(NAP["verify"]) or {}
    loop.maybe_checkpoint = lambda: time.sleep(NAP["checkpoint"]) or False
    loop.wait_for_evaluations = lambda: None  # after the last step: in no step's window
    t0 = time.perf_counter()
    loop.run()
    wall = time.perf_counter() - t0
    rows = loop.duties.rows
    assert [("sync_seconds" in r, "log_seconds" in r) for r in rows] == [(False, False), (True, True),
                                                                         (False, True), (True, True)]
    assert all({"wait_seconds", "routing_seconds", "train_seconds"} <= set(r) for r in rows)
    tail = NAP["log"] + NAP["eval"] + NAP["checkpoint"]  # the last step's: after its row
    assert sum(r["step_seconds"] for r in rows) == pytest.approx(wall - tail, abs=0.03)
    for r in rows:
        named = [r[f"{p}_seconds"] for p in PHASES if f"{p}_seconds" in r]
        assert sum(named) + r["other_seconds"] == pytest.approx(r["step_seconds"], abs=1e-9)
        for p in PHASES:
            if f"{p}_seconds" in r:
                assert r[f"{p}_seconds"] >= NAP[p], (p, r)
        # every stubbed part is in its phase: other is the untimed part of a sync step, plus a little
        assert r["other_seconds"] == pytest.approx(UNTIMED if "sync_seconds" in r else 0.0, abs=0.015), r
