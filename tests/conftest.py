"""Shared fixtures: tiny checkpoints made once per session, torchrun launcher for gloo jobs, and the records of
the reliability suite (``-m reliability``; ``scripts/reliability_report.py`` turns them into docs/reliability.md)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import socket
import subprocess
from dataclasses import asdict, dataclass, field

import pytest

from mrl.process import torchrun

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory):
    """{preset: path} of the three built-in checkpoints (tiny, stress_a, stress_b)."""
    from mrl.config.schema import TinyPreset
    from mrl.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("ckpts")
    return {p.value: make_tiny_model(str(root / p.value), p) for p in TinyPreset}


@pytest.fixture(scope="session")
def image() -> str:
    """The built CPU image's tag (``make image``), rebuilt from this tree first (cached layers: seconds when nothing
    changed); the test is skipped, with the reason, only where no image exists (no podman, or never built)."""
    from tests.container.podman import image_tag, missing_reason, rebuilt

    tag = image_tag()
    if reason := missing_reason(tag):
        pytest.skip(reason)
    return rebuilt(tag)


def run_torchrun(module: str, args: list[str], nproc: int, timeout: float = 300) -> subprocess.CompletedProcess:
    return torchrun(module, args, nproc, timeout=timeout, cwd=REPO)


@contextlib.contextmanager
def one_rank_gloo_world():
    """A one-process gloo world on a free port for in-process megatron models; the environment restored and
    megatron's groups torn down after."""
    from mrl.megatron.parallel import destroy

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    keys = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    try:
        yield
    finally:
        destroy()
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def write_every_ranks_rows(rows: list[dict], path: str) -> None:
    """A torchrun worker's last step: every rank's rows gathered, written by rank 0 as JSON lines."""
    import torch.distributed as dist

    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, rows)
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for rs in everyone for r in rs)


def read_json(path) -> dict:
    with open(path) as f:
        return json.load(f)


# -- reliability records (scripts/reliability_report.py renders them into docs/reliability.md) ---------
RELIABILITY_ENV = "MRL_RELIABILITY_DIR"
# Tests of these files belong to the reliability suite without a marker of their own (category per file).
RELIABILITY_FILES = {"tests/unit/test_fuzz.py": "fuzz"}


@dataclass
class ReliabilityRecord:
    """What one injected fault or bad input was and what came out."""

    category: str
    """fault | timeout | bad_input | access"""
    name: str
    injected: str = ""
    expected: str = ""
    survived: bool | None = None
    message: str = ""
    """The error or log line the fault produced (what a user sees)."""
    samples: dict | None = None
    """{generated, trained, dropped, failed, retried, lost} for runs that generate."""
    details: dict = field(default_factory=dict)


class Reliability:
    """``reliability.record(category=..., name=..., ...)``, any number of times per test."""

    def __init__(self, test: str):
        self.test, self.records = test, []

    def record(self, **fields) -> ReliabilityRecord:
        self.records.append(rec := ReliabilityRecord(**fields))
        return rec


def pytest_sessionstart(session):
    """The orphans of killed test jobs (their engines, ranks) are handed to this process rather than to
    PID 1, which in a container may never reap them; engines do the same (mrl.process.become_subreaper)."""
    from mrl.process import become_subreaper

    become_subreaper()


def pytest_sessionfinish(session, exitstatus):
    from mrl.process import reap_zombies

    reap_zombies()  # the orphans handed over (see pytest_sessionstart)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.split("::")[0] in RELIABILITY_FILES:
            item.add_marker("reliability")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    rep = (yield).get_result()
    if rep.when == "call" or (rep.when == "setup" and rep.outcome != "passed"):
        _write_outcome(item, rep)


def _record_path(nodeid: str, suffix: str) -> str | None:
    out = os.environ.get(RELIABILITY_ENV)
    if not out:
        return None
    os.makedirs(out, exist_ok=True)
    return os.path.join(out, hashlib.sha1(nodeid.encode()).hexdigest()[:16] + suffix)


def _write_outcome(item, rep) -> None:
    if item.get_closest_marker("reliability") is None or not (path := _record_path(item.nodeid, ".outcome.json")):
        return
    outcome = "xfailed" if hasattr(rep, "wasxfail") else rep.outcome
    category = RELIABILITY_FILES.get(item.nodeid.split("::")[0], "")
    # hypothesis tests: the examples that ran (every phase), from the statistics its pytest plugin keeps
    cases = sum(map(int, re.findall(r"(\d+) passing", getattr(item, "hypothesis_statistics", "") or ""))) or None
    with open(path, "w") as f:
        json.dump({"test": item.nodeid, "outcome": outcome, "seconds": round(rep.duration, 2), "category": category,
                   "xfail_reason": getattr(rep, "wasxfail", ""), "hypothesis_cases": cases}, f)


@pytest.fixture
def reliability(request) -> Reliability:
    """What the test injected and saw; written (the outcome beside it) when ``$MRL_RELIABILITY_DIR`` is set."""
    rel = Reliability(request.node.nodeid)
    yield rel
    if rel.records and (path := _record_path(request.node.nodeid, ".record.json")):
        with open(path, "w") as f:
            json.dump({"test": rel.test, "records": [asdict(r) for r in rel.records]}, f, indent=1, default=str)
