"""Bridges of the families beyond Qwen3 (GLM-4.5, DeepSeek-V3): config translation, the real models' shapes,
and bad input failing before anything loads (coverage and exact inverse: ``test_bridge.py``)."""

import json
import os
import re
import shutil

import pytest
from safetensors.torch import load_file, save_file

from mrl.models import UnsupportedModelError, get_bridge
from mrl.models.checkpoint import CheckpointError, HFCheckpoint

def test_glm4_moe_config_translation(ckpt_dir):
    b = get_bridge(ckpt_dir["glm4_moe"])
    kw = b.transformer_config_kwargs()
    assert kw["moe_layer_freq"] == [0, 1, 1]  # first_k_dense_replace=1
    assert kw["kv_channels"] == 24 and kw["num_query_groups"] == 2
    assert kw["moe_router_score_function"] == "sigmoid" and kw["moe_router_enable_expert_bias"] is True
    assert kw["moe_router_bias_update_rate"] == 0.0  # the bias stays the checkpoint's
    assert kw["moe_router_topk_scaling_factor"] == 2.5
    assert kw["moe_router_num_groups"] is None and kw["moe_router_group_topk"] is None  # n_group=1
    assert kw["moe_shared_expert_intermediate_size"] == 32
    assert kw["add_qkv_bias"] is True and kw["add_bias_linear"] is False and kw["qk_layernorm"] is True
    g = b.gpt_model_kwargs(512)
    assert g["rotary_percent"] == 0.5 and g["rotary_base"] == 500000.0
    shapes = b.hf_tensor_shapes(512)
    assert shapes["model.layers.1.mlp.gate.e_score_correction_bias"] == (8,)
    assert shapes["model.layers.0.self_attn.q_proj.bias"] == (96,)
    assert "model.layers.0.mlp.gate.weight" not in shapes  # the dense layer
    pm = next(p for p in b.param_maps(512) if p.mcore_name == "decoder.layers.0.self_attention.linear_qkv.bias")
    assert [(p.hf_name.split(".")[-2], p.start, p.stop) for p in pm.segments[0]] == [
        ("q_proj", 0, 48), ("k_proj", 0, 24), ("v_proj", 0, 24), ("q_proj", 48, 96), ("k_proj", 24, 48),
        ("v_proj", 24, 48)]


# GLM-4.5-Air's config.json (public), the shapes a cluster user loads
GLM45_AIR = dict(vocab_size=151552, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
                 num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
                 n_routed_experts=128, num_experts_per_tok=8, n_shared_experts=1, routed_scaling_factor=1.0,
                 n_group=1, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True, use_qk_norm=False,
                 attention_bias=True, partial_rotary_factor=0.5, rope_theta=1000000.0, rms_norm_eps=1e-5,
                 max_position_embeddings=131072, tie_word_embeddings=False)


def _write_config(tmp_path, name, arch, **kw):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": [arch], **kw}))
    return str(d)


def test_glm45_air_shapes(tmp_path):
    b = get_bridge(_write_config(tmp_path, "air", "Glm4MoeForCausalLM", model_type="glm4_moe", **GLM45_AIR))
    kw = b.transformer_config_kwargs()
    assert kw["moe_layer_freq"] == [0] + [1] * 45 and kw["kv_channels"] == 128
    assert kw["moe_shared_expert_intermediate_size"] == 1408 and kw["qk_layernorm"] is False
    assert b.gpt_model_kwargs(151552)["rotary_percent"] == 0.5
    shapes = b.hf_tensor_shapes(b.padded_vocab(128, 8))
    assert shapes["model.layers.1.mlp.experts.127.gate_proj.weight"] == (1408, 4096)
    assert shapes["model.layers.1.mlp.shared_experts.down_proj.weight"] == (4096, 1408)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (96 * 128, 4096)
    assert "model.layers.0.self_attn.q_norm.weight" not in shapes
    assert sum(1 for k in shapes if k.endswith("e_score_correction_bias")) == 45


BAD_CONFIGS = [  # (preset, config.json change, what the error must name)
    ("glm4_moe", dict(n_group=3, topk_group=1), "n_group=3"),
    ("glm4_moe", dict(n_group=4, topk_group=2, num_experts_per_tok=8), "topk_group=2"),
    ("glm4_moe", dict(n_group=2, topk_group=4), "topk_group=4"),
    ("glm4_moe", dict(norm_topk_prob=False), "norm_topk_prob"),
    ("glm4_moe", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                       "original_max_position_embeddings": 512}), "rope_scaling type 'yarn'"),
    ("glm4_moe", dict(hidden_act="gelu"), "hidden_act"),
    ("deepseek_v3", dict(n_group=3), "n_group=3"),  # does not divide 8 experts
    ("deepseek_v3", dict(topk_group=2), "topk_group=2"),  # HF's top-2 group score vs megatron's top-(k / topk_group)
    ("deepseek_v3", dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}),
     "rope_scaling type 'linear'"),
    ("deepseek_v3", dict(attention_bias=True), "attention_bias=true"),
    ("deepseek_v3", dict(scoring_func="softmax"), "scoring_func='softmax'"),
    ("deepseek_v3", dict(topk_method="group_limited_greedy"), "topk_method='group_limited_greedy'"),
    ("deepseek_v3", dict(rope_interleave=False), "rope_interleave=false"),
]


@pytest.mark.parametrize("preset,change,field", BAD_CONFIGS)
def test_bad_config_names_the_field(ckpt_dir, tmp_path, preset, change, field):
    dst = tmp_path / "bad"
    shutil.copytree(ckpt_dir[preset], dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(change)
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=field):
        get_bridge(str(dst))


def test_checkpoint_of_another_family_names_the_tensors(ckpt_dir, tmp_path):
    """GLM's config.json over Qwen3-MoE tensors (and the reverse): the tensor check fails before loading."""
    dst = tmp_path / "mixed"
    shutil.copytree(ckpt_dir["glm4_moe"], dst)
    shutil.copy(os.path.join(ckpt_dir["stress_a"], "model.safetensors"), dst / "model.safetensors")
    b = get_bridge(str(dst))
    with pytest.raises(CheckpointError, match=r"missing tensors: .*e_score_correction_bias"):
        HFCheckpoint(str(dst)).check_against(b.hf_tensor_shapes(512))


def test_tiny_preset_of_another_family_is_refused(ckpt_dir):
    """``model=glm4_moe_tiny`` with ``model.hf_path`` at an existing Qwen3-MoE checkpoint."""
    from mrl.models.tiny import check_preset

    with pytest.raises(ValueError, match=r"model.hf_path=.*Qwen3MoeForCausalLM.*model.tiny_preset=glm4_moe"):
        check_preset(ckpt_dir["tiny"], "glm4_moe")
    check_preset(ckpt_dir["glm4_moe"], "glm4_moe")
    check_preset(ckpt_dir["stress_a"], "tiny")  # same family


def test_deepseek_v3_config_translation(ckpt_dir):
    b = get_bridge(ckpt_dir["deepseek_v3"])
    kw = b.transformer_config_kwargs()
    assert kw["multi_latent_attention"] is True and kw["moe_layer_freq"] == [0, 1, 1]
    assert (kw["q_lora_rank"], kw["kv_lora_rank"], kw["qk_head_dim"], kw["qk_pos_emb_head_dim"],
            kw["v_head_dim"]) == (32, 16, 16, 8, 16)
    assert kw["moe_router_num_groups"] == 2 and kw["moe_router_group_topk"] == 1
    assert kw["moe_router_score_function"] == "sigmoid" and kw["moe_router_topk_scaling_factor"] == 2.5
    assert (kw["rope_type"], kw["rotary_scaling_factor"], kw["original_max_position_embeddings"]) == ("yarn", 4.0, 512)
    assert (kw["mscale"], kw["mscale_all_dim"], kw["beta_fast"], kw["beta_slow"]) == (1.0, 1.0, 32.0, 1.0)
    shapes = b.hf_tensor_shapes(512)
    assert shapes["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == (16 + 8, 64)
    assert shapes["model.layers.0.self_attn.kv_b_proj.weight"] == (4 * (16 + 16), 16)
    assert shapes["model.layers.0.self_attn.q_b_proj.weight"] == (4 * (16 + 8), 32)
    with open(os.path.join(ckpt_dir["deepseek_v3"], "config.json")) as f:
        raw = json.load(f)
    assert {k: raw[k] for k in b.engine_config()} == b.engine_config()  # what SGLang reads is in the file


# DeepSeek-V3's config.json (public); Kimi-K2 differs in 384 experts and 64 heads
DEEPSEEK_V3 = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                   num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
                   kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                   n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, routed_scaling_factor=2.5,
                   n_group=8, topk_group=4, first_k_dense_replace=3, norm_topk_prob=True, moe_layer_freq=1,
                   topk_method="noaux_tc", scoring_func="sigmoid", num_nextn_predict_layers=1,
                   max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False,
                   rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                 "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
                   rope_theta=10000)


def test_deepseek_v3_shapes_and_mtp_layer_skipped(tmp_path):
    b = get_bridge(_write_config(tmp_path, "v3", "DeepseekV3ForCausalLM", model_type="deepseek_v3", **DEEPSEEK_V3))
    kw = b.transformer_config_kwargs()
    assert kw["moe_layer_freq"] == [0] * 3 + [1] * 58
    assert (kw["moe_router_num_groups"], kw["moe_router_group_topk"], kw["rotary_scaling_factor"]) == (8, 4, 40.0)
    shapes = b.hf_tensor_shapes(b.padded_vocab(128, 8))
    assert shapes["model.layers.3.mlp.experts.255.down_proj.weight"] == (7168, 2048)
    assert shapes["model.layers.60.self_attn.kv_a_proj_with_mqa.weight"] == (576, 7168)
    assert not any(k.startswith("model.layers.61.") for k in shapes)
    mtp = ["model.layers.61.eh_proj.weight", "model.layers.61.mlp.experts.0.up_proj.weight"]
    assert b.skipped_hf_tensors(mtp + ["model.layers.60.input_layernorm.weight"]) == sorted(mtp)


@pytest.mark.parametrize("preset,name", [("glm4_moe", "model.layers.2.mlp.gate.e_score_correction_bias"),
                                         ("deepseek_v3", "model.layers.1.self_attn.kv_b_proj.weight")])
def test_missing_tensor_is_named(ckpt_dir, tmp_path, preset, name):
    """The score-correction bias (a buffer in transformers), an MLA projection."""
    dst = tmp_path / "missing"
    shutil.copytree(ckpt_dir[preset], dst)
    sd = load_file(str(dst / "model.safetensors"))
    del sd[name]
    save_file(sd, str(dst / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"missing tensors: \['{re.escape(name)}'\]"):
        HFCheckpoint(str(dst)).check_against(get_bridge(str(dst)).hf_tensor_shapes(512))
