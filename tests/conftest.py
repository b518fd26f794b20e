"""Shared fixtures: tiny checkpoints made once per session, torchrun launcher for gloo jobs."""

from __future__ import annotations

import json
import os
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
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def read_json(path) -> dict:
    with open(path) as f:
        return json.load(f)
