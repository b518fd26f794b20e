"""A run's engines come from one place (``RunEngines``): the job starts its own early (the colocated ones
when the controller asks), attached ones are never started, and each is started once."""

from __future__ import annotations

import pytest

from mrl.trainer import engines as run_engines


class _Server:
    def __init__(self, i: int):
        self.url, self.healthy, self.stopped = f"http://127.0.0.1:{9000 + i}", False, False
        self.endpoint = self.url

    def wait_healthy(self):
        self.healthy = True

    def stop(self):
        self.stopped = True


@pytest.fixture
def starts(monkeypatch):
    calls = []

    def start_job_engines(cfg):
        calls.append(cfg.engine.count)
        return [_Server(i) for i in range(cfg.engine.count)]

    monkeypatch.setattr(run_engines, "start_job_engines", start_job_engines)
    return calls


def _cfg(tmp_path, *overrides):
    from mrl.config.load import compose

    return compose([f"run_dir={tmp_path}", "engine.count=2", *overrides])


def test_the_jobs_engines_start_early_once(tmp_path, starts):
    engines = run_engines.RunEngines(_cfg(tmp_path)).start_early()
    assert starts == [2] and not any(e.healthy for e in engines.started)
    assert engines.ready() == ["http://127.0.0.1:9000", "http://127.0.0.1:9001"]
    assert starts == [2] and all(e.healthy for e in engines.started)  # not started again
    engines.stop()
    assert all(e.stopped for e in engines.started)


def test_colocated_engines_start_when_the_controller_asks(tmp_path, starts):
    engines = run_engines.RunEngines(_cfg(tmp_path, "engine.memory_saver=true")).start_early()
    assert starts == [] and engines.started == []
    assert len(engines.ready()) == 2 and starts == [2]


def test_attached_engines_are_never_started(tmp_path, starts):
    engines = run_engines.RunEngines(_cfg(tmp_path, "engine.urls=[http://a:1,http://b:2]")).start_early()
    assert [e.url for e in engines.ready()] == ["http://a:1", "http://b:2"]
    assert starts == [] and engines.started == []
