"""Engine processes never outlive their launcher, and startup failures surface with the server log."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import psutil
import pytest

from mrl.rollout.engine import Engine, EngineStartError
from tests.conftest import REPO

LAUNCHER = """
import json, sys, time
from mrl.rollout.engine import Engine
e = Engine(model_path=sys.argv[1], tp=1, log_dir=sys.argv[2], name="orphan").start().wait_healthy(600)
print(json.dumps(e.pids()), flush=True)
time.sleep(3600)
"""


def _alive(pids):
    out = []
    for p in pids:
        try:
            if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def test_engine_dies_with_a_killed_launcher(ckpt_dir, tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, ckpt_dir["tiny"], str(tmp_path)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(proc.stdout.readline())
        assert len(pids) >= 3, pids  # server, scheduler, detokenizer
        assert _alive(pids) == pids
        proc.send_signal(signal.SIGKILL)  # no atexit, no finally: only PDEATHSIG can clean up
        proc.wait()
        deadline = time.monotonic() + 30
        while _alive(pids) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _alive(pids), f"engine processes survived their launcher: {_alive(pids)}"
    finally:
        proc.kill()


def test_a_picked_port_taken_before_the_server_binds_it_is_replaced(tmp_path, ckpt_dir, monkeypatch):
    """free_port() can only pick a port that is free now; here another socket takes it first. A port
    the caller chose is never swapped: that start fails, naming the cause."""
    import socket

    import mrl.rollout.engine as engine_mod

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    picks = iter([busy])
    real = engine_mod.free_port
    monkeypatch.setattr(engine_mod, "free_port", lambda host="127.0.0.1": next(picks, None) or real(host))
    eng = Engine(model_path=ckpt_dir["tiny"], tp=1, log_dir=str(tmp_path), name="picked")
    fixed = Engine(model_path=ckpt_dir["tiny"], tp=1, log_dir=str(tmp_path), name="fixed", port=busy)
    assert eng.port == busy
    try:
        eng.start()
        fixed.start()
        eng.wait_healthy(timeout=300)
        assert eng.port != busy
        assert f"port {busy} was taken before the server bound it" in eng.log_tail(200)
        with pytest.raises(EngineStartError, match="address already in use"):
            fixed.wait_healthy(timeout=300)
    finally:
        eng.stop()
        fixed.stop()
        taken.close()
    assert eng.pids() == [] and fixed.pids() == []


def test_startup_failure_reports_the_log(tmp_path):
    bad = tmp_path / "not_a_model"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["NoSuchModel"], "model_type": "nosuch"}))
    eng = Engine(model_path=str(bad), tp=1, log_dir=str(tmp_path), name="bad")
    eng.start()
    with pytest.raises(EngineStartError) as e:
        eng.wait_healthy(timeout=300)
    assert "exited with code" in str(e.value) and str(tmp_path) in str(e.value)
    eng.stop()
    assert eng.pids() == []
