"""The pieces of bench/export_time.py that decide its result without a GPU: the bitwise round-trip check of an
export against the HF checkpoint it started from, and the choice of saving Adam's states or not from mrl's
memory estimate of the trainer's GPU."""

import argparse
import json
import os
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import export_time  # noqa: E402
from _random_checkpoint import SHAPES, make_checkpoint  # noqa: E402


def _rewrite(path, fn):
    """Each safetensors file of ``path`` with ``fn(tensors)`` applied (the index left as it is)."""
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            t = load_file(os.path.join(path, f))
            save_file(fn(t), os.path.join(path, f), metadata={"format": "pt"})


@pytest.fixture
def src(tmp_path):
    return make_checkpoint(str(tmp_path / "src"), "tiny", None, seed=1, shard_gb=0.0001)


def _copy(src, tmp_path, name="out"):
    return shutil.copytree(src, str(tmp_path / name))


def test_an_unchanged_copy_is_equal_tensor_by_tensor(src, tmp_path):
    r = export_time.compare(src, _copy(src, tmp_path))
    assert r["equal"] and r["dtypes"] == ["bfloat16->bfloat16"]
    assert r["tensors"] == len(export_time.weight_map(src)) and r["bytes"] == export_time.tensor_bytes(src)


def test_one_flipped_bit_is_found(src, tmp_path):
    out = _copy(src, tmp_path)
    name = "model.layers.1.mlp.experts.5.down_proj.weight"

    def flip(t):
        if name in t:
            x = t[name].clone()
            x.view(torch.int16)[3, 7] ^= 1  # the lowest mantissa bit of one element
            t[name] = x
        return t

    _rewrite(out, flip)
    r = export_time.compare(src, out)
    assert not r["equal"] and r["mismatched"] == [name] and r["counts"]["mismatched"] == 1


def test_a_missing_tensor_is_named(src, tmp_path):
    out = _copy(src, tmp_path)
    _rewrite(out, lambda t: {k: v for k, v in t.items() if k != "lm_head.weight"})
    # the export's own index is what the check reads: drop the tensor there too
    index = os.path.join(out, export_time.INDEX)
    with open(index) as f:
        d = json.load(f)
    del d["weight_map"]["lm_head.weight"]
    with open(index, "w") as f:
        json.dump(d, f)
    r = export_time.compare(src, out)
    assert not r["equal"] and r["missing"] == ["lm_head.weight"]


def test_an_fp32_trainers_export_is_the_exact_widening(src, tmp_path):
    """A trainer in fp32 (CPU) exports fp32: equal when it is bf16's exact widening, not when a value moved
    by less than bf16 can show."""
    out = _copy(src, tmp_path)
    _rewrite(out, lambda t: {k: v.float() for k, v in t.items()})
    r = export_time.compare(src, out)
    assert r["equal"] and r["dtypes"] == ["bfloat16->float32"]
    _rewrite(out, lambda t: {k: (v + 1e-6 if k == "model.norm.weight" else v) for k, v in t.items()})
    assert export_time.compare(src, out)["mismatched"] == ["model.norm.weight"]


def _choose(monkeypatch, gib, layers, state="auto"):
    monkeypatch.setattr(export_time, "gpu_memory_gib", lambda: gib)
    a = argparse.Namespace(dtype="bf16", optimizer_states="bf16", parallel="tp1", nproc=1, optimizer_state=state)
    return export_time.choose_optimizer_state(a, dict(SHAPES["qwen3_30b_a3b"], num_hidden_layers=layers), True)


def test_the_30b_slice_keeps_adams_states_where_the_gpu_holds_them(monkeypatch):
    """The 12-layer slice with bf16 Adam states: an H200 (139.8 GiB) holds them, an 80 GB H100 (79.2 GiB) does
    not (its checkpoint is then saved without them; 8 layers fit), and nothing holds the 48-layer model's
    weights and grads on one GPU."""
    state, _, est = _choose(monkeypatch, 139.8, 12)
    assert state == "adam" and 100 < est["adam_gib"] < 110
    state, why, est = _choose(monkeypatch, 79.2, 12)
    assert state == "none" and est["largest_adam_layers"] == 8 and "8 layers" in why
    assert 16.0e9 < est["checkpoint_bytes"]["none"] < 16.5e9  # the bf16 weights alone
    with pytest.raises(SystemExit, match=r"--optimizer-state adam: .*\(--layers 8,"):
        _choose(monkeypatch, 79.2, 12, "adam")
    with pytest.raises(SystemExit, match="without Adam's states"):
        _choose(monkeypatch, 79.2, 48)
