"""Checkpoint + restart: RL steps k+1.. are bit-identical to an uninterrupted run (EP2 = DP2, so the
DistributedOptimizer's Adam state is sharded; megatron dist_checkpointing, torch-Adam fixes #10-12), with
the optimizer state in each of train.optimizer_checkpoint's formats."""

import json

import pytest

from tests.conftest import run_torchrun

pytestmark = pytest.mark.dist


def _rows(out):
    return [json.loads((out.parent / f"{out.name}.rank{r}").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def uninterrupted(ckpt_dir, tmp_path_factory):
    """The 4 steps without a stop, each rank's rows: the same run for every test here (the optimizer
    checkpoint's format and the save's mode change what is written, not what is trained)."""
    out = tmp_path_factory.mktemp("uninterrupted") / "a"
    r = run_torchrun("tests.jobs.resume_check", ["--hf", ckpt_dir["tiny"], "--parallel", "ep2", "--steps", "4",
                                                 "--out", str(out)], 2, timeout=400)
    assert r.returncode == 0, r.stderr[-4000:]
    return _rows(out)


@pytest.mark.parametrize("fmt", ["dp_reshardable", "fully_reshardable"])
def test_resume_is_bit_identical(ckpt_dir, tmp_path, fmt, uninterrupted):
    base = ["--hf", ckpt_dir["tiny"], "--parallel", "ep2", "--steps", "4", "--optimizer-checkpoint", fmt]
    for args in (["--stop-after", "2", "--ckpt", str(tmp_path / "ck"), "--out", str(tmp_path / "b1")],
                 ["--resume", str(tmp_path / "ck"), "--out", str(tmp_path / "b2")]):
        r = run_torchrun("tests.jobs.resume_check", base + args, 2, timeout=400)
        assert r.returncode == 0, r.stderr[-4000:]
    a, b1, b2 = uninterrupted, _rows(tmp_path / "b1"), _rows(tmp_path / "b2")
    for rank in range(2):
        assert [x["step"] for x in b1[rank]] == [1, 2] and [x["step"] for x in b2[rank]] == [3, 4]
        assert b1[rank] + b2[rank] == a[rank]  # losses, grad norms, lr and parameter checksums, exactly
    assert a[0][0]["sum"] != a[0][3]["sum"]  # the steps really changed the weights
    assert json.loads((tmp_path / "ck" / "optimizer_format.json").read_text())["format"] == fmt
    # the preflight's lower bound on a checkpoint (mrl/megatron/memory.py) holds for a real one
    from mrl.config.schema import DType
    from mrl.megatron.memory import checkpoint_bytes
    from mrl.models import get_bridge

    b = get_bridge(ckpt_dir["tiny"], json_config=True)
    _, low = checkpoint_bytes(b, dtype=DType.fp32, optimizer_states_dtype=DType.fp32,
                              padded_vocab=b.padded_vocab(128, 1), optimizer_checkpoint=fmt)
    on_disk = sum(p.stat().st_size for p in (tmp_path / "ck").rglob("*.distcp"))
    assert low <= on_disk <= 2 * low, (low, on_disk)


def test_an_async_save_holds_the_step_it_was_scheduled_at(ckpt_dir, tmp_path, uninterrupted):
    """train.async_save: the save is scheduled after step 2, one more step changes every weight while the
    forked writer runs, then the save completes; a restart from it runs steps 3-4 exactly as the
    uninterrupted run does."""
    base = ["--hf", ckpt_dir["tiny"], "--parallel", "ep2", "--steps", "4"]
    for args in (["--stop-after", "2", "--async-save", "--ckpt", str(tmp_path / "ck"), "--out", str(tmp_path / "b1")],
                 ["--resume", str(tmp_path / "ck"), "--out", str(tmp_path / "b2")]):
        r = run_torchrun("tests.jobs.resume_check", base + args, 2, timeout=400)
        assert r.returncode == 0, r.stderr[-4000:]
    a, b1, b2 = uninterrupted, _rows(tmp_path / "b1"), _rows(tmp_path / "b2")
    for rank in range(2):
        assert [x["step"] for x in b2[rank]] == [3, 4]
        assert b1[rank] + b2[rank] == a[rank]
    assert (tmp_path / "ck" / ".metadata").is_file()  # megatron's finalizer ran
