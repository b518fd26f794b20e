"""Synthetic weights (``mrl.models.synthetic``): the same values as the random checkpoint the bench writes,
read through the same importer, with no file but config.json."""

import os
import sys

import pytest
import torch

from mrl.models import get_bridge
from mrl.models.checkpoint import CheckpointError, HFCheckpoint
from mrl.models.synthetic import SyntheticWeights, synthetic_tensor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from _random_checkpoint import make_checkpoint, make_config_dir  # noqa: E402


def test_synthetic_weights_equal_the_written_random_checkpoint_slice_by_slice(tmp_path):
    ck = HFCheckpoint(make_checkpoint(str(tmp_path / "ck"), "tiny", None, seed=5, shard_gb=0.0001))
    cfg_dir = make_config_dir(str(tmp_path / "cfg"), "tiny", None)
    assert sorted(os.listdir(cfg_dir)) == ["config.json"]
    w = SyntheticWeights(cfg_dir, seed=5)
    assert w.shapes == ck.shapes
    for name, shape in ck.shapes.items():
        assert torch.equal(w.read(name), ck.read(name)), name
        if len(shape) == 2:
            assert torch.equal(w.read(name, rows=(1, 3), cols=(2, 5)), ck.read(name, rows=(1, 3), cols=(2, 5)))
    streamed = dict(w.tensors())
    assert list(streamed) == list(w.shapes)
    assert all(torch.equal(streamed[k], ck.read(k)) for k in streamed)
    assert w.num_bytes == sum(t.numel() * 2 for t in streamed.values())
    assert not torch.equal(SyntheticWeights(cfg_dir, seed=6).read("lm_head.weight"), ck.read("lm_head.weight"))
    with pytest.raises(CheckpointError, match="no tensor 'model.layers.9.mlp.gate.weight'"):
        w.read("model.layers.9.mlp.gate.weight")


def test_values_follow_the_init_and_the_cache_stays_bounded(tmp_path):
    cfg_dir = make_config_dir(str(tmp_path / "cfg"), "cpu_wide", None)
    w = SyntheticWeights(cfg_dir, seed=0, cache_bytes=1 << 20)
    emb = w.read("model.embed_tokens.weight").float()
    assert abs(emb.std().item() - 0.02) < 1e-3 and abs(emb.mean().item()) < 1e-3
    assert torch.equal(w.read("model.layers.0.input_layernorm.weight"), torch.ones(256, dtype=torch.bfloat16))
    for e in range(64):
        w.read(f"model.layers.1.mlp.experts.{e}.up_proj.weight")
    assert sum(t.numel() * t.element_size() for t in w._cache.values()) <= 1 << 20
    # two tensors of one shape differ: each has its own generator
    a, b = (synthetic_tensor(f"model.layers.0.mlp.experts.{e}.down_proj.weight", (4, 4)) for e in (0, 1))
    assert not torch.equal(a, b)


def test_mismatched_model_is_refused(tmp_path):
    w = SyntheticWeights(make_config_dir(str(tmp_path / "a"), "tiny", None))
    other = get_bridge(make_config_dir(str(tmp_path / "b"), "tiny", 2))
    with pytest.raises(CheckpointError, match="do not match the model"):
        w.check_against(other.hf_tensor_shapes(512))
