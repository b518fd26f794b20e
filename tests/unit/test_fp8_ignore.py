"""``engine.fp8_ignore``: modules kept in high precision by FP8 engines. The run's export, the copy plan's
FP8 buckets, the CUDA IPC and disk transports all follow the list, and each of them equals ``mrl export-fp8
--ignore`` of the same weights, byte for byte; the config, the preflight and the export refuse what SGLang
could not load."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mrl.config.load import compose
from mrl.quant.export import export_fp8
from mrl.weight_sync import fp8 as sync_fp8
from mrl.weight_sync import planner
from mrl.weight_sync.planner import TrainerLayout

IGNORED = ("model.layers.0", "self_attn")  # a whole layer, and every attention projection of the others
FP8 = "float8_e4m3fn"


def _bf16_copy(ckpt_dir, tmp_path) -> str:
    src = tmp_path / "bf16"
    src.mkdir()
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(f"{ckpt_dir['tiny_gpu']}/model.safetensors").items()},
              str(src / "model.safetensors"))
    (src / "config.json").write_text(open(f"{ckpt_dir['tiny_gpu']}/config.json").read())
    return str(src)


def _kept(name: str) -> bool:
    return name.startswith("model.layers.0.") or ".self_attn." in name


def test_export_and_every_transport_keep_the_ignored_modules(ckpt_dir, tmp_path):
    from mrl.models import get_bridge
    from mrl.models.bridge import full_from_parts
    from mrl.weight_sync.tensor import bucket_tensors

    src = _bf16_copy(ckpt_dir, tmp_path)
    export_fp8(src, str(tmp_path / "fp8"), ignored=IGNORED, log=lambda *_: None)
    want = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    with open(tmp_path / "fp8" / "config.json") as f:
        skipped = json.load(f)["quantization_config"]["modules_to_not_convert"]
    assert "model.layers.0.mlp.experts.0.gate_proj" in skipped and "model.layers.1.self_attn.q_proj" in skipped
    quantized = [k for k, v in want.items() if v.dtype == torch.float8_e4m3fn]
    assert quantized and not any(_kept(k) for k in quantized)  # layer 1's experts are still FP8
    assert want["model.layers.1.self_attn.q_proj.weight"].dtype == torch.bfloat16

    hf = load_file(os.path.join(src, "model.safetensors"))
    disk = sync_fp8.quantize_checkpoint({k: v.float() for k, v in hf.items()}, torch.bfloat16, ignored=IGNORED)
    bridge = get_bridge(ckpt_dir["tiny_gpu"])
    gathered = [(None, pm, full_from_parts(pm, hf)) for pm in bridge.param_maps(bridge.padded_vocab(128, 1))]
    ipc = dict(bucket_tensors(gathered, fp8_from=torch.bfloat16, fp8_ignore=IGNORED))
    for got in (disk, ipc):
        assert set(got) == set(want)
        for k, v in want.items():
            g = got[k].to(torch.bfloat16) if got[k].dtype == torch.float32 and v.dtype == torch.bfloat16 else got[k]
            assert g.dtype == v.dtype and torch.equal(g.view(torch.uint8), v.view(torch.uint8)), k


def test_the_copy_plan_quantizes_what_the_plan_says(ckpt_dir):
    """The planned FP8 entries leave the ignored modules in the sync dtype, and the sender's quantizer
    writes exactly those entries (a quantizer that disagreed with the plan would refuse to build)."""
    from mrl.megatron.weights import LocalParam
    from mrl.models import get_bridge
    from mrl.models.bridge import split_full
    from mrl.weight_sync.copy_plan import build_steps

    bridge = get_bridge(ckpt_dir["tiny_gpu"])
    vp = bridge.padded_vocab(128, 1)
    maps = {pm.mcore_name: pm for pm in bridge.param_maps(vp)}
    g = torch.Generator().manual_seed(0)
    local = {n: LocalParam(n, torch.nn.Parameter(torch.randn(pm.shape, generator=g) * 0.02, requires_grad=False), n,
                           ".experts." in n, None, None) for n, pm in maps.items()}
    layout = TrainerLayout(1, 1, 1, 1, 1)
    plan = planner.plan_sync(bridge.param_maps(vp), layout, num_layers=bridge.num_layers,
                             num_experts=bridge.num_experts, bucket_bytes=256 << 10, dtype="bfloat16", fp8=True,
                             fp8_ignore=IGNORED)
    entries = [t for b in plan.buckets for t in b.tensors]
    assert any(t.dtype == FP8 for t in entries)
    assert not any(t.dtype == FP8 and _kept(t.name) for t in entries)
    assert any(t.name == "model.layers.0.mlp.experts.0.up_proj.weight" and t.dtype == "bfloat16" for t in entries)
    steps, _ = build_steps(plan.buckets, local, maps, rank=0, dp_rank=0, edp_rank=0, dtype=torch.bfloat16,
                           device=torch.device("cpu"))
    checked = 0
    for step in (s for s in steps if s.quantize is not None):
        step.fill()
        staged = sync_fp8.staged_bucket(step.bucket, "bfloat16")
        values = [split_full(maps[p.mcore_name], local[p.mcore_name].param.detach())[t.name].to(torch.bfloat16)
                  for p in staged.params for t in p.tensors]
        got, want = sync_fp8.quantize_bucket(staged.tensors, values, ignored=IGNORED)
        assert got == step.bucket.tensors and torch.equal(step.flat, want)
        checked += 1
    assert checked >= 1


def test_the_runs_export_follows_the_list(ckpt_dir, tmp_path):
    from mrl.engine.fp8_model import MARKER, ensure_fp8_model

    run = str(tmp_path / "run")
    path = ensure_fp8_model(ckpt_dir["tiny_gpu"], run, log=lambda *_: None)
    mtime = os.path.getmtime(os.path.join(path, MARKER))
    assert ensure_fp8_model(ckpt_dir["tiny_gpu"], run, ignored=list(IGNORED), log=lambda *_: None) == path
    assert os.path.getmtime(os.path.join(path, MARKER)) != mtime  # another list: exported again
    with open(os.path.join(path, MARKER)) as f:
        assert json.load(f)["ignored"] == sorted(IGNORED)
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        assert str(f.get_slice("model.layers.1.self_attn.q_proj.weight").get_dtype()) == "F32"  # as the source
        assert str(f.get_slice("model.layers.1.mlp.experts.0.gate_proj.weight").get_dtype()) == "F8_E4M3"
    mtime = os.path.getmtime(os.path.join(path, MARKER))
    assert ensure_fp8_model(ckpt_dir["tiny_gpu"], run, ignored=list(reversed(IGNORED)), log=lambda *_: None)
    assert os.path.getmtime(os.path.join(path, MARKER)) == mtime  # the same list in another order: reused


@pytest.mark.parametrize("overrides, message", [
    (["engine=gpu", "model.dtype=bf16", "engine.fp8_ignore=[self_attn]"],
     r"engine.fp8_ignore: =\['self_attn'\] keeps modules out of FP8, but engine.quantization=None"),
    (["engine=gpu", "model.dtype=bf16", "engine.quantization=fp8", "engine.fp8_ignore=['model.layers 0']"],
     r"engine.fp8_ignore: entries must be dotted module paths"),
])
def test_the_config_refuses_a_list_it_cannot_use(overrides, message):
    with pytest.raises(ValueError, match=message):
        compose(overrides)


def test_preflight_refuses_a_list_that_splits_a_fused_layer(ckpt_dir):
    from mrl.preflight import check_fp8_shapes

    base = ["engine=gpu", "model.dtype=bf16", "engine.quantization=fp8", "model.make_tiny_if_missing=false",
            f"model.hf_path={ckpt_dir['tiny_gpu']}"]
    assert check_fp8_shapes(compose([*base, "engine.fp8_ignore=[model.layers.0,self_attn]"]), "local") is None
    msg = check_fp8_shapes(compose([*base, "engine.fp8_ignore=[model.layers.0.self_attn.q_proj]"]), "local")
    assert msg.startswith("engine.fp8_ignore=['model.layers.0.self_attn.q_proj']: model.layers.0.self_attn.qkv_proj")
    assert "ignore all of it or none" in msg
    msg = check_fp8_shapes(compose([*base, "engine.fp8_ignore=[model.layers.1.mlp.experts.3]"]), "local")
    assert "model.layers.1.mlp.experts" in msg
