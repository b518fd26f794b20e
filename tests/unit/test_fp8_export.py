"""``mrl export-fp8``: the block-FP8 checkpoint of the tiny model. Every quantized tensor dequantizes within
the per-element bound, every other tensor and side file is byte-equal, shards and index, refusals, and
transformers' own FP8 loader reads it back to the same weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from mrl.models.checkpoint import HFCheckpoint
from mrl.models.tiny import make_tiny_model
from mrl.quant.export import export_fp8
from mrl.quant.fp8_format import scale_shape
from mrl.quant.fp8_targets import is_fp8_target
from tests.conftest import REPO
from tests.unit.fp8_reference import dequantize_block_fp8, error_bound


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_export")
    src = make_tiny_model(str(root / "tiny"))
    dst = str(root / "tiny_fp8")
    summary = export_fp8(src, dst, log=lambda *_: None)
    return src, dst, summary


def _tensors(path: str) -> dict[str, torch.Tensor]:
    out = {}
    for fn in sorted(os.listdir(path)):
        if fn.endswith(".safetensors"):
            with safe_open(os.path.join(path, fn), framework="pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_every_tensor_quantized_within_bound_or_byte_equal(tiny):
    src, dst, summary = tiny
    a, b = _tensors(src), _tensors(dst)
    quantized = [n for n in a if is_fp8_target(n)]
    assert summary["quantized"] == len(quantized) == 3 * (4 + 8 * 3)
    assert set(b) == set(a) | {n + "_scale_inv" for n in quantized}
    for n, w in a.items():
        if n in quantized:
            q, s = b[n], b[n + "_scale_inv"]
            assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape, n
            assert s.dtype == torch.float32 and tuple(s.shape) == scale_shape(tuple(w.shape)), n
            err = (w.double() - dequantize_block_fp8(q, s).double()).abs()
            assert (err <= error_bound(w, s)).all(), n
        else:
            assert b[n].dtype == w.dtype and torch.equal(b[n].view(torch.uint8), w.view(torch.uint8)), n


def test_config_and_side_files(tiny):
    src, dst, _ = tiny
    with open(os.path.join(src, "config.json")) as f:
        c0 = json.load(f)
    with open(os.path.join(dst, "config.json")) as f:
        c1 = json.load(f)
    qc = c1.pop("quantization_config")
    assert c1 == c0
    assert qc["quant_method"] == "fp8" and qc["fmt"] == "e4m3" and qc["activation_scheme"] == "dynamic"
    assert qc["weight_block_size"] == [128, 128]
    assert qc["modules_to_not_convert"] == ["lm_head"] + [f"model.layers.{i}.mlp.gate" for i in range(3)]
    for fn in ("tokenizer.json", "generation_config.json"):
        with open(os.path.join(src, fn), "rb") as f0, open(os.path.join(dst, fn), "rb") as f1:
            assert f0.read() == f1.read(), fn
    assert not os.path.exists(os.path.join(dst, "model.safetensors.index.json"))


def test_shards_and_index(tiny, tmp_path):
    src, dst, _ = tiny
    out = str(tmp_path / "sharded")
    summary = export_fp8(src, out, shard_bytes=100_000, log=lambda *_: None)
    assert summary["shards"] > 3
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index = json.load(f)
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert files == [f"model-{i:05d}-of-{summary['shards']:05d}.safetensors" for i in range(1, summary["shards"] + 1)]
    assert not any(f.endswith(".partial") for f in os.listdir(out))
    assert set(index["weight_map"].values()) == set(files)
    one, many = _tensors(dst), _tensors(out)
    assert set(one) == set(many) == set(index["weight_map"])
    assert all(torch.equal(one[n].view(torch.uint8), many[n].view(torch.uint8)) for n in one)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in many.values())
    assert set(HFCheckpoint(out).shapes) == set(many)  # mrl's own reader takes the index


def test_ignored_modules_stay_in_high_precision(tiny, tmp_path):
    src, _, _ = tiny
    out = str(tmp_path / "ignored")
    export_fp8(src, out, ignored=["model.layers.1.self_attn"], log=lambda *_: None)
    b = _tensors(out)
    assert b["model.layers.1.self_attn.q_proj.weight"].dtype == torch.float32
    assert "model.layers.1.self_attn.q_proj.weight_scale_inv" not in b
    assert b["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    with open(os.path.join(out, "config.json")) as f:
        skipped = json.load(f)["quantization_config"]["modules_to_not_convert"]
    assert "model.layers.1.self_attn.o_proj" in skipped and "model.layers.0.self_attn.o_proj" not in skipped


def test_refusals(tiny, tmp_path):
    src, dst, _ = tiny
    with pytest.raises(ValueError, match="already has a quantization_config"):
        export_fp8(dst, str(tmp_path / "again"), log=lambda *_: None)
    with pytest.raises(FileExistsError, match="already holds a checkpoint"):
        export_fp8(src, dst, log=lambda *_: None)
    with pytest.raises(ValueError, match="another directory"):
        export_fp8(src, src, log=lambda *_: None)
    with pytest.raises(ValueError, match="qkv_proj: SGLang loads it as one FP8 layer"):
        export_fp8(src, str(tmp_path / "split"), ignored=["model.layers.0.self_attn.v_proj"], log=lambda *_: None)


def test_transformers_reads_it_back(tiny, monkeypatch):
    """transformers' fine-grained FP8 loader (on CPU it dequantizes) gets the weights mrl's dequantization
    gives: names, scale layout and block orientation are the format's."""
    import transformers
    import transformers.quantizers.quantizer_finegrained_fp8 as qf
    from transformers.utils import is_accelerate_available

    if not is_accelerate_available():  # checked at load but not used by a dequantizing CPU load
        monkeypatch.setattr(qf, "is_accelerate_available", lambda: True)
    src, dst, _ = tiny
    model = transformers.AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32)
    sd = model.state_dict()
    b = _tensors(dst)
    for n in ("model.layers.0.self_attn.q_proj.weight", "model.layers.2.self_attn.o_proj.weight"):
        assert torch.equal(sd[n].float(), dequantize_block_fp8(b[n], b[n + "_scale_inv"])), n
    gate_up = sd["model.layers.1.mlp.experts.gate_up_proj"]  # transformers-5 fuses the experts it reads
    g = "model.layers.1.mlp.experts.3.gate_proj.weight"
    assert torch.equal(gate_up[3, :gate_up.shape[1] // 2].float(), dequantize_block_fp8(b[g], b[g + "_scale_inv"]))
    assert torch.equal(sd["model.layers.0.mlp.gate.weight"], b["model.layers.0.mlp.gate.weight"])


def test_cli(tiny, tmp_path):
    src, dst, _ = tiny
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    out = str(tmp_path / "cli")
    r = subprocess.run([sys.executable, "-m", "mrl", "export-fp8", src, out], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "84 of 102 tensors block-FP8 (128x128)" in r.stdout
    r = subprocess.run([sys.executable, "-m", "mrl", "export-fp8", src, dst], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 1 and "already holds a checkpoint" in r.stderr
