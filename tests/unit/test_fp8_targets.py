"""Which HF tensors a block-FP8 checkpoint stores in e4m3 (mrl.quant.fp8_targets), on every tensor of the
three families' tiny presets, and SGLang's block-shape rules on real models' shapes."""

from __future__ import annotations

import pytest
import transformers

from mrl.config.schema import TinyPreset
from mrl.models import BRIDGES
from mrl.models.tiny import FAMILIES, PRESETS
from mrl.quant.fp8_targets import (check_fused_groups, is_fp8_target, modules_to_not_convert, scale_inv_name,
                                   sglang_shape_problems)


def _names(preset: TinyPreset) -> list[str]:
    config_cls, arch = FAMILIES[preset]
    cfg = getattr(transformers, config_cls)(architectures=[arch], **PRESETS[preset])
    return sorted(BRIDGES[arch](cfg).hf_tensor_shapes(cfg.vocab_size))


def _quantized(preset):
    names = _names(preset)
    return names, {n for n in names if is_fp8_target(n)}


def test_qwen3_moe():
    names, q = _quantized(TinyPreset.tiny)
    for i in range(3):
        for leaf in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert f"model.layers.{i}.self_attn.{leaf}.weight" in q
        for e in range(8):
            for leaf in ("gate_proj", "up_proj", "down_proj"):
                assert f"model.layers.{i}.mlp.experts.{e}.{leaf}.weight" in q
    kept = set(names) - q
    assert all(("norm" in n or n.endswith("mlp.gate.weight") or n in ("model.embed_tokens.weight", "lm_head.weight"))
               for n in kept), sorted(kept)
    assert "model.layers.0.mlp.gate.weight" in kept and "model.layers.0.self_attn.q_norm.weight" in kept
    assert len(q) == 3 * (4 + 8 * 3)


def test_qwen3_dense_layers():
    names, q = _quantized(TinyPreset.stress_a)  # layer 2 is a dense MLP
    for leaf in ("gate_proj", "up_proj", "down_proj"):
        assert f"model.layers.2.mlp.{leaf}.weight" in q


def test_glm4_moe_shared_experts_and_biases():
    names, q = _quantized(TinyPreset.glm4_moe)
    assert "model.layers.1.mlp.shared_experts.gate_proj.weight" in q
    assert "model.layers.0.mlp.down_proj.weight" in q  # first layer dense
    assert "model.layers.0.self_attn.q_proj.bias" not in q and "model.layers.0.self_attn.q_proj.bias" in names
    assert "model.layers.1.mlp.gate.e_score_correction_bias" not in q
    assert "model.layers.1.mlp.gate.weight" not in q


def test_deepseek_v3_mla():
    names, q = _quantized(TinyPreset.deepseek_v3)
    for leaf in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
        assert f"model.layers.0.self_attn.{leaf}.weight" in q
    for n in ("model.layers.0.self_attn.q_a_layernorm.weight", "model.layers.0.self_attn.kv_a_layernorm.weight",
              "model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias"):
        assert n in names and n not in q
    assert "model.layers.1.mlp.shared_experts.down_proj.weight" in q


@pytest.mark.parametrize("name", ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                                  "model.layers.0.mlp.gate.weight", "model.layers.0.mlp.gate_up_proj.weight",
                                  "model.layers.0.self_attn.q_proj.bias", "model.layers.0.input_layernorm.weight",
                                  "model.layers.0.mlp.experts.gate_up_proj", "model.layers.3.eh_proj.weight"])
def test_kept_in_high_precision(name):
    assert not is_fp8_target(name)


def test_scale_name():
    n = "model.layers.0.self_attn.q_proj.weight"
    assert scale_inv_name(n) == "model.layers.0.self_attn.q_proj.weight_scale_inv"
    with pytest.raises(ValueError, match="only weights"):
        scale_inv_name("model.layers.0.self_attn.q_proj.bias")


def test_ignored_modules_match_whole_path_components():
    n = "model.layers.0.mlp.gate_proj.weight"
    assert is_fp8_target(n, ignored=["mlp.gate"])  # a router name must not catch gate_proj
    assert not is_fp8_target(n, ignored=["model.layers.0.mlp"])
    assert not is_fp8_target(n, ignored=["layers.0"])
    assert is_fp8_target(n, ignored=["layers.1"])


def test_modules_to_not_convert_lists_head_routers_and_ignored():
    names = _names(TinyPreset.tiny)
    assert modules_to_not_convert(names) == ["lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate",
                                             "model.layers.2.mlp.gate"]
    out = modules_to_not_convert(names, ignored=["model.layers.2"])
    assert "model.layers.2.self_attn.q_proj" in out and "model.layers.2.mlp.experts.7.down_proj" in out
    assert "model.layers.1.self_attn.q_proj" not in out


def test_a_fused_group_quantized_in_part_is_refused():
    names = _names(TinyPreset.tiny)
    check_fused_groups(names, ignored=["model.layers.0.self_attn", "model.layers.1.mlp.experts"])
    with pytest.raises(ValueError, match="self_attn.qkv_proj: SGLang loads it as one FP8 layer"):
        check_fused_groups(names, ignored=["model.layers.0.self_attn.k_proj"])
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.experts: SGLang loads it as one FP8 layer"):
        check_fused_groups(names, ignored=["model.layers.0.mlp.experts.3"])


def _cfg(**kw):
    return transformers.Qwen3MoeConfig(**kw)


QWEN3_30B_A3B = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     moe_intermediate_size=768, intermediate_size=6144, num_experts=128, decoder_sparse_step=1,
                     mlp_only_layers=[])


def test_sglang_shape_rules_on_qwen3_30b_a3b():
    c = _cfg(**QWEN3_30B_A3B)
    assert sglang_shape_problems(c, 1) == []
    assert sglang_shape_problems(c, 2) == []         # experts 384 per rank
    assert sglang_shape_problems(c, 8, 8) == []      # EP: experts whole on each rank
    p = sglang_shape_problems(c, 4)                  # 768 / 4 = 192: SGLang's known refusal
    assert len(p) == 2 and "experts' gate_proj/up_proj = 192" in p[0] and "experts' down_proj = 192" in p[1]


def test_sglang_shape_rules_on_the_tiny_presets():
    tiny = _cfg(**{k: v for k, v in PRESETS[TinyPreset.tiny].items()})
    assert any("q_proj = 64" in p for p in sglang_shape_problems(tiny))
    gpu = _cfg(**{k: v for k, v in PRESETS[TinyPreset.tiny_gpu].items()})
    assert sglang_shape_problems(gpu) == []  # the GPU tests' tiny model loads as block FP8
