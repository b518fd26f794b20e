"""Engine processes never outlive their launcher, and startup failures surface with the server log."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from mrl.engine.launcher import Engine, EngineStartError
from tests.conftest import REPO

# An engine started from a launcher process that is then SIGKILLed. Its first port, picked by free_port(),
# is taken by another socket before the server binds it (free_port can only pick a port that is free now):
# the engine must come up on a fresh one.
LAUNCHER = """
import json, sys, time
import mrl.engine.launcher as m
busy, real = int(sys.argv[3]), m.free_port
picks = iter([busy])
m.free_port = lambda host="127.0.0.1": next(picks, None) or real(host)
e = m.Engine(model_path=sys.argv[1], tp=1, log_dir=sys.argv[2], name="orphan")
assert e.port == busy, e.port
e.start().wait_healthy(600)
print(json.dumps({"pids": e.pids(), "port": e.port}), flush=True)
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


def test_port_taken_before_bind_and_killed_launcher(ckpt_dir, tmp_path):
    """A picked port taken before the server binds it is replaced; a port the caller chose is never swapped
    (that start fails, naming the cause); the engine's processes die with a SIGKILLed launcher."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    fixed = Engine(model_path=ckpt_dir["tiny"], tp=1, log_dir=str(tmp_path), name="fixed", port=busy)
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, ckpt_dir["tiny"], str(tmp_path), str(busy)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    try:
        fixed.start()  # both boot at once
        with pytest.raises(EngineStartError, match="address already in use"):
            fixed.wait_healthy(timeout=300)
        line = proc.stdout.readline()
        assert line, f"the launcher exited ({proc.wait()}) without a healthy engine"
        started = json.loads(line)
        pids = started["pids"]
        assert started["port"] != busy
        assert f"port {busy} was taken before the server bound it" in open(tmp_path / "orphan.log").read()
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
        fixed.stop()
        taken.close()
    assert fixed.pids() == []


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


def test_stopped_engine_leaves_no_zombies(ckpt_dir, tmp_path):
    """``stop`` reaps the server's children itself: the server dies before it can, and PID 1 in a container
    is often not an init that reaps the zombies handed to it."""
    with Engine(model_path=ckpt_dir["tiny"], tp=1, log_dir=str(tmp_path), name="reaped") as eng:
        eng.wait_healthy(300)
        pids = eng.pids()
        assert len(pids) >= 3, pids  # server, scheduler, detokenizer
    left = {p: psutil.Process(p).status() for p in pids if psutil.pid_exists(p)}
    assert not left, f"processes of a stopped engine still in the process table: {left}"
