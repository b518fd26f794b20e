"""The start phases of a run (mrl/startup.py): counted from the launch stamp that `mrl train` sets and its
ranks inherit, first mark kept, unknown names refused."""

import pytest

from mrl import startup


def test_phases_count_from_the_launch_stamp(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(startup.time, "time", lambda: now[0])
    monkeypatch.delenv(startup.LAUNCHED_AT, raising=False)
    startup.stamp_launch()
    now[0] = 1500.0
    startup.stamp_launch()  # a launcher above keeps its own start
    assert float(startup.os.environ[startup.LAUNCHED_AT]) == 1000.0
    clock = startup.StartupClock()  # a rank started later reads the stamp
    now[0] = 1012.5
    clock.mark("policy_ready")
    now[0] = 1030.0
    clock.mark("policy_ready")  # the first time stays
    clock.mark("first_step")
    assert clock.metrics() == {"startup/policy_ready_s": 12.5, "startup/first_step_s": 30.0}
    assert clock.summary() == "first step done 30 s after launch (trainer ready 12 s)"
    with pytest.raises(ValueError, match="unknown start phase 'ready'"):
        clock.mark("ready")


def test_without_a_stamp_a_process_counts_from_its_own_start(monkeypatch):
    monkeypatch.delenv(startup.LAUNCHED_AT, raising=False)
    clock = startup.StartupClock()
    clock.mark("trainer_imported")
    assert 0 <= clock.marks["trainer_imported"] < 1.0
