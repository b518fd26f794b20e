"""Shared fixtures: tiny checkpoints made once per session, torchrun launcher for gloo jobs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory):
    """{preset: path} of the three built-in checkpoints (tiny, stress_a, stress_b)."""
    from mrl.config.schema import TinyPreset
    from mrl.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("ckpts")
    return {p.value: make_tiny_model(str(root / p.value), p) for p in TinyPreset}


def run_torchrun(module: str, args: list[str], nproc: int, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", module, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # own session: on a timeout the whole tree (torchrun and its workers) is killed, no orphans
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{module} timed out after {timeout}s:\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def read_json(path) -> dict:
    with open(path) as f:
        return json.load(f)
