"""Bridges: mapping coverage and exact inverse (every family's tiny checkpoint), Qwen3-MoE config
translation, bad checkpoints."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from mrl.models import UnsupportedModelError, get_bridge
from mrl.models.bridge import full_from_parts, split_full
from mrl.models.checkpoint import CheckpointError, HFCheckpoint

PRESETS = ["tiny", "stress_a", "stress_b", "glm4_moe", "deepseek_v3"]


@pytest.mark.parametrize("preset", PRESETS)
def test_mapping_covers_every_hf_tensor_once(ckpt_dir, preset):
    bridge = get_bridge(ckpt_dir[preset])
    vp = bridge.padded_vocab(128, 1)
    ckpt = HFCheckpoint(ckpt_dir[preset])
    assert bridge.hf_tensor_shapes(vp) == ckpt.shapes
    rows_used: dict[str, int] = {}
    for pm in bridge.param_maps(vp):
        for seg in pm.segments:
            for p in seg:
                if p.hf_name:
                    rows_used[p.hf_name] = rows_used.get(p.hf_name, 0) + p.num_rows
    # every row of every HF tensor is used exactly once (tied: the embedding map only)
    assert rows_used == {k: v[0] for k, v in ckpt.shapes.items()}


@pytest.mark.parametrize("preset", PRESETS)
def test_full_roundtrip_is_bit_exact(ckpt_dir, preset):
    bridge = get_bridge(ckpt_dir[preset])
    vp = bridge.padded_vocab(128, 2)
    hf = load_file(os.path.join(ckpt_dir[preset], "model.safetensors"))
    back = {}
    for pm in bridge.param_maps(vp):
        full = full_from_parts(pm, hf)
        assert tuple(full.shape) == pm.shape
        back.update(split_full(pm, full))
    assert set(back) == set(hf)
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_config_translation_stress_a(ckpt_dir):
    b = get_bridge(ckpt_dir["stress_a"])
    kw = b.transformer_config_kwargs()
    assert kw["kv_channels"] == 24 and kw["num_query_groups"] == 2 and kw["layernorm_epsilon"] == 1e-6
    assert kw["moe_layer_freq"] == [1, 1, 0, 1]  # mlp_only_layers=[2]
    assert kw["moe_router_pre_softmax"] is False  # norm_topk_prob=True
    assert b.gpt_model_kwargs(512)["rotary_base"] == 1e6
    assert b.padded_vocab(128, 1) == 512 and b.padded_vocab(128, 4) == 512


def test_config_translation_stress_b(ckpt_dir):
    b = get_bridge(ckpt_dir["stress_b"])
    kw = b.transformer_config_kwargs()
    assert kw["moe_layer_freq"] == [0, 1, 0, 1]  # decoder_sparse_step=2: MoE at layers 1, 3
    assert kw["moe_router_pre_softmax"] is True  # norm_topk_prob=False
    assert kw["moe_router_topk"] == 4 and kw["num_moe_experts"] == 16
    assert b.gpt_model_kwargs(384)["share_embeddings_and_output_weights"] is True
    assert "lm_head.weight" not in b.hf_tensor_shapes(384)


def test_qkv_rows_interleave_by_kv_group(ckpt_dir):
    b = get_bridge(ckpt_dir["stress_b"])  # 8 q heads, 2 kv groups, head_dim 12
    pm = next(p for p in b.param_maps(384) if p.mcore_name == "decoder.layers.0.self_attention.linear_qkv.weight")
    (seg,) = pm.segments
    names = [(p.hf_name.split(".")[-2], p.start, p.stop) for p in seg]
    assert names == [("q_proj", 0, 48), ("k_proj", 0, 12), ("v_proj", 0, 12),
                     ("q_proj", 48, 96), ("k_proj", 12, 24), ("v_proj", 12, 24)]


def _write_variant(src, dst, mutate):
    shutil.copytree(src, dst)
    f = os.path.join(dst, "model.safetensors")
    sd = load_file(f)
    mutate(sd)
    save_file(sd, f)
    return dst


@pytest.mark.parametrize("kind", ["missing", "extra", "misshaped"])
def test_bad_checkpoint_names_the_tensor(ckpt_dir, tmp_path, kind):
    name = "model.layers.1.mlp.experts.3.up_proj.weight"

    def mutate(sd):
        if kind == "missing":
            del sd[name]
        elif kind == "extra":
            sd["model.layers.1.mlp.experts.99.up_proj.weight"] = sd[name].clone()
        else:
            sd[name] = sd[name][:-1].contiguous()

    path = _write_variant(ckpt_dir["tiny"], tmp_path / kind, mutate)
    bridge = get_bridge(str(path))
    with pytest.raises(CheckpointError) as e:
        HFCheckpoint(str(path)).check_against(bridge.hf_tensor_shapes(512))
    msg = str(e.value)
    assert {"missing": "missing tensors", "extra": "unexpected tensors", "misshaped": "mis-shaped"}[kind] in msg
    assert ("experts.99.up_proj" if kind == "extra" else name) in msg


def test_unsupported_architecture_is_a_clear_error(ckpt_dir, tmp_path):
    dst = tmp_path / "mixtral"
    shutil.copytree(ckpt_dir["tiny"], dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["architectures"] = ["MixtralForCausalLM"]
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=r"MixtralForCausalLM.*Qwen3MoeForCausalLM"):
        get_bridge(str(dst))


def test_unsupported_rope_scaling_is_refused(ckpt_dir, tmp_path):
    dst = tmp_path / "yarn"
    shutil.copytree(ckpt_dir["tiny"], dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                              "original_max_position_embeddings": 512}
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="rope_type='yarn'"):
        get_bridge(str(dst))


def test_missing_config_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        get_bridge(str(tmp_path))


def test_fused_expert_checkpoint_reads_like_per_expert(ckpt_dir, tmp_path):
    """transformers-5 save_pretrained writes fused experts; slices must equal the per-expert file."""
    src = load_file(os.path.join(ckpt_dir["tiny"], "model.safetensors"))
    fused = {k: v for k, v in src.items() if ".experts." not in k}
    for layer in range(3):
        pre = f"model.layers.{layer}.mlp.experts."
        fused[pre + "gate_up_proj"] = torch.stack(
            [torch.cat([src[f"{pre}{e}.gate_proj.weight"], src[f"{pre}{e}.up_proj.weight"]]) for e in range(8)])
        fused[pre + "down_proj"] = torch.stack([src[f"{pre}{e}.down_proj.weight"] for e in range(8)])
    d = tmp_path / "fused"
    shutil.copytree(ckpt_dir["tiny"], d)
    save_file(fused, str(d / "model.safetensors"))
    ck = HFCheckpoint(str(d))
    assert ck.shapes == HFCheckpoint(ckpt_dir["tiny"]).shapes
    for k in src:
        assert torch.equal(ck.read(k), src[k]), k
    assert torch.equal(ck.read("model.layers.2.mlp.experts.5.up_proj.weight", (4, 20), (8, 40)),
                       src["model.layers.2.mlp.experts.5.up_proj.weight"][4:20, 8:40])


def test_tiny_model_is_deterministic_and_has_tokenizer(ckpt_dir, tmp_path):
    from tokenizers import Tokenizer

    from mrl.models.tiny import make_tiny_model

    again = make_tiny_model(str(tmp_path / "again"))
    a = load_file(os.path.join(ckpt_dir["tiny"], "model.safetensors"))
    b = load_file(os.path.join(again, "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    tok = Tokenizer.from_file(os.path.join(again, "tokenizer.json"))
    assert tok.get_vocab_size() <= 512
    ids = tok.encode("reverse abc 12+30=42").ids
    assert tok.decode(ids) == "reverse abc 12+30=42"
    assert [tok.token_to_id(t) for t in ("<pad>", "<bos>", "<eos>")] == [0, 1, 2]


@pytest.mark.parametrize("te,local", [
    ("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", "decoder.layers.0.input_layernorm.weight"),
    ("decoder.layers.2.mlp.linear_fc1.layer_norm_weight", "decoder.layers.2.pre_mlp_layernorm.weight"),
    ("decoder.layers.1.mlp.experts.linear_fc1.weight7",
     "decoder.layers.1.mlp.experts.local_experts.7.linear_fc1.weight"),
    ("decoder.layers.1.mlp.experts.linear_fc2.weight0",
     "decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight"),
    ("decoder.layers.1.pre_mlp_layernorm.weight", "decoder.layers.1.pre_mlp_layernorm.weight"),
    ("decoder.layers.1.self_attention.linear_qkv.weight", "decoder.layers.1.self_attention.linear_qkv.weight"),
])
def test_transformer_engine_names_map_to_local_spec_names(te, local):
    from mrl.models.bridge import local_spec_name

    assert local_spec_name(te) == local
