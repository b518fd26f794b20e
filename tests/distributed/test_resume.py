"""Checkpoint + restart: RL steps k+1.. are bit-identical to an uninterrupted run (EP2 = DP2, so the
DistributedOptimizer's Adam state is sharded; megatron dist_checkpointing, torch-Adam fixes #10-12)."""

import json

import pytest

from tests.conftest import run_torchrun

pytestmark = pytest.mark.dist


def _rows(out):
    return [json.loads((out.parent / f"{out.name}.rank{r}").read_text()) for r in range(2)]


def test_resume_is_bit_identical(ckpt_dir, tmp_path):
    base = ["--hf", ckpt_dir["tiny"], "--parallel", "ep2", "--steps", "4"]
    for args in (["--out", str(tmp_path / "a")],
                 ["--stop-after", "2", "--ckpt", str(tmp_path / "ck"), "--out", str(tmp_path / "b1")],
                 ["--resume", str(tmp_path / "ck"), "--out", str(tmp_path / "b2")]):
        r = run_torchrun("tests.jobs.resume_check", base + args, 2, timeout=400)
        assert r.returncode == 0, r.stderr[-4000:]
    a, b1, b2 = _rows(tmp_path / "a"), _rows(tmp_path / "b1"), _rows(tmp_path / "b2")
    for rank in range(2):
        assert [x["step"] for x in b1[rank]] == [1, 2] and [x["step"] for x in b2[rank]] == [3, 4]
        assert b1[rank] + b2[rank] == a[rank]  # losses, grad norms, lr and parameter checksums, exactly
    assert a[0][0]["sum"] != a[0][3]["sum"]  # the steps really changed the weights
