"""Checkpoint files on disk: the newest ``train.keep_checkpoints`` complete checkpoints are kept, a
directory without its marker (being written, or left by a crash) is never counted nor deleted, and
every file is synced before the marker is written."""

from __future__ import annotations

import os

import pytest

from mrl.config.schema import TrainConfig
from mrl.process import LOOP_STATE_FILE
from mrl.trainer.state import prune_checkpoints, sync_tree


def _ckpt(root, step: int, complete: bool = True) -> None:
    d = root / f"step_{step}"
    os.makedirs(d / "shards")
    (d / "shards" / "0.distcp").write_bytes(b"x" * 10)
    if complete:
        (d / LOOP_STATE_FILE).write_text("{}")


def test_only_the_newest_complete_checkpoints_are_kept(tmp_path):
    for step, complete in ((2, True), (4, True), (10, True), (12, False), (6, True), (1, False)):
        _ckpt(tmp_path, step, complete)
    assert prune_checkpoints(str(tmp_path), 0) == []  # 0 keeps every one
    assert sorted(prune_checkpoints(str(tmp_path), 2)) == ["step_2", "step_4"]  # by step, not by name
    assert sorted(os.listdir(tmp_path)) == ["step_1", "step_10", "step_12", "step_6"]
    assert prune_checkpoints(str(tmp_path), 2) == []


def test_sync_tree_walks_files_and_directories(tmp_path):
    _ckpt(tmp_path, 3)
    sync_tree(str(tmp_path / "step_3"))  # every file and directory opened and synced, nothing changed
    assert (tmp_path / "step_3" / "shards" / "0.distcp").read_bytes() == b"x" * 10


def test_negative_keep_is_refused():
    with pytest.raises(ValueError, match="train.keep_checkpoints"):
        TrainConfig(keep_checkpoints=-1)


def test_optimizer_format_is_recorded_and_read_back(tmp_path):
    from mrl.config.schema import ParallelConfig
    from mrl.megatron import checkpoint_format as cf

    ep2 = ParallelConfig(ep=2)
    assert cf.read_format(str(tmp_path), ep2) == "fully_reshardable"  # written before the record existed
    cf.write_record(str(tmp_path), "dp_reshardable", ep2, 2)
    assert cf.read_format(str(tmp_path), ep2) == "dp_reshardable"
    assert cf.read_format(str(tmp_path), ParallelConfig(ep=2, etp=1)) == "dp_reshardable"  # etp null = tp
    with pytest.raises(cf.CheckpointError, match=r"tp 1 -> 2.*fully_reshardable"):
        cf.read_format(str(tmp_path), ParallelConfig(tp=2, ep=2))  # another model-parallel layout
    cf.write_record(str(tmp_path), "fully_reshardable", ep2, 2)
    assert cf.read_format(str(tmp_path), ParallelConfig(tp=2)) == "fully_reshardable"  # any layout resumes it


def test_optimizer_format_metadata_and_validation():
    from mrl.megatron import checkpoint_format as cf

    assert cf.metadata("dp_reshardable") == {"distrib_optim_sharding_type": "dp_reshardable",
                                             "chained_optim_avoid_prefix": True}
    assert cf.metadata("fully_reshardable")["distrib_optim_fully_reshardable_mem_efficient"] is True
    with pytest.raises(ValueError, match="train.optimizer_checkpoint"):
        TrainConfig(optimizer_checkpoint="fully_sharded_model_space")
