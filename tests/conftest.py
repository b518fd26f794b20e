"""Shared fixtures: tiny checkpoints made once per session, torchrun launcher for gloo jobs."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from mrl.jobs import torchrun

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory):
    """{preset: path} of the three built-in checkpoints (tiny, stress_a, stress_b)."""
    from mrl.config.schema import TinyPreset
    from mrl.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("ckpts")
    return {p.value: make_tiny_model(str(root / p.value), p) for p in TinyPreset}


def run_torchrun(module: str, args: list[str], nproc: int, timeout: float = 300) -> subprocess.CompletedProcess:
    return torchrun(module, args, nproc, timeout=timeout, cwd=REPO)


def read_json(path) -> dict:
    with open(path) as f:
        return json.load(f)
