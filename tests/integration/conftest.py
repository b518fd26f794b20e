"""Real SGLang 0.5.14 engines in CPU mode, started once per test session (TP=1 and TP=2, tiny model).

They run with the session's keys (api and admin) and ``$MRL_ENGINE_KEYS_FILE`` names them for the whole
session, so every client here, and every job these tests start, authenticates as in a real run."""

from __future__ import annotations

import concurrent.futures
import os

import pytest

from mrl.process import open_files
from mrl.engine.launcher import Engine
from mrl.sglang.keys import ENV_VAR, ensure_run_secrets


@pytest.fixture(scope="session")
def engines(ckpt_dir, tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("engine_logs"))
    before = os.environ.get(ENV_VAR)
    keys = ensure_run_secrets(str(tmp_path_factory.mktemp("run")))
    specs = {"tp1": Engine(model_path=ckpt_dir["tiny"], tp=1, log_dir=logs, name="tp1", secrets=keys),
             "tp2": Engine(model_path=ckpt_dir["tiny"], tp=2, log_dir=logs, name="tp2", secrets=keys)}
    for e in specs.values():
        e.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            list(ex.map(lambda e: e.wait_healthy(timeout=600), specs.values()))
        yield specs
    finally:
        pids = {n: e.pids() for n, e in specs.items()}
        shm = {path for ps in pids.values() for path in open_files(ps, "/dev/shm/")}
        for e in specs.values():
            e.stop()
        left = {n: e.pids() for n, e in specs.items()}
        assert all(pids.values()), f"engine process groups were empty before stop: {pids}"
        if before is None:
            os.environ.pop(ENV_VAR, None)
        assert not any(left.values()), f"engine processes survived stop(): {left}"
        assert shm, "the engines held no file in /dev/shm (SGLang's load reports): nothing was checked"
        assert not [p for p in shm if os.path.exists(p)], f"/dev/shm files the engines held outlived them: {shm}"
