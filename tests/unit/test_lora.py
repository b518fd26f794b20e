"""LoRA without a process group: config checks (the field named), PEFT names, sites and shapes from the bridge,
the adapter's fused-linear delta against the per-HF-module LoRA, merge, and adapter directories."""

import json

import pytest
import torch

from mrl.config.load import compose
from mrl.config.schema import LoraConfig
from mrl.models import get_bridge
from mrl.models.bridge import full_from_parts
from mrl.models.peft import (base_name, check_peft, load_peft, lora_sites, merge_peft, peft_config, peft_name,
                             peft_shapes, save_peft)

ALL = ["attention", "dense_mlp", "experts"]


@pytest.mark.parametrize("kw,field,msg", [
    (dict(rank=-1), "model.lora.rank", "must be >= 0"),
    (dict(rank=4, alpha=0.0), "model.lora.alpha", "positive"),
    (dict(rank=4, targets=["router"]), "model.lora.targets", "router cannot be a LoRA target"),
    (dict(rank=4, targets=["gate"]), "model.lora.targets", "router cannot be a LoRA target"),
    (dict(rank=4, targets=["attention", "mlp"]), "model.lora.targets", "unknown target 'mlp'"),
    (dict(rank=4, targets=["attention", "attention"]), "model.lora.targets", "twice"),
    (dict(rank=4, targets=[]), "model.lora.targets", "is empty"),
])
def test_config_errors_name_the_field(kw, field, msg):
    with pytest.raises(ValueError, match=msg) as e:
        LoraConfig(**kw)
    assert str(e.value).startswith(field + ":")


def test_config_composes_and_maps_to_hf_modules():
    off = compose()
    assert off.model.lora.rank == 0 and not off.model.lora.enabled
    cfg = compose(["model.lora.rank=8", "model.lora.alpha=16", "model.lora.targets=[experts,attention]",
                   "engine=gpu", "model.dtype=bf16"])  # expert adapters are served by GPU engines only
    lora = cfg.model.lora
    assert lora.enabled and lora.scale == 2.0
    assert lora.hf_target_modules == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert LoraConfig(rank=2, targets=["dense_mlp"]).hf_target_modules == ["gate_proj", "up_proj", "down_proj"]
    with pytest.raises(ValueError, match="model.lora.targets: 'router'"):
        compose(["model.lora.rank=8", "model.lora.targets=[router]"])


def test_peft_names():
    n = peft_name("model.layers.3.mlp.experts.5.gate_proj.weight", "B")
    assert n == "base_model.model.model.layers.3.mlp.experts.5.gate_proj.lora_B.weight"
    assert base_name(n) == "model.layers.3.mlp.experts.5.gate_proj.weight"
    with pytest.raises(ValueError, match="not a PEFT LoRA tensor name"):
        base_name("model.layers.3.mlp.gate_proj.weight")


def test_sites_and_shapes(ckpt_dir):
    """stress_a: 4 layers (layer 2 dense, intermediate 96), 4 q heads / 2 KV heads of 24, hidden 64, 8 experts
    of 32."""
    bridge = get_bridge(ckpt_dir["stress_a"])
    lora = LoraConfig(rank=4, targets=ALL)
    sites = lora_sites(bridge, lora)
    assert len(sites) == 4 * 2 + 1 * 2 + 3 * 8 * 2
    qkv = next(s for s in sites if s.mcore_name == "decoder.layers.0.self_attention.linear_qkv.weight")
    assert qkv.kind == "column" and [h.split(".")[-2] for h in qkv.hf_modules] == ["q_proj", "k_proj", "v_proj"]
    shapes = peft_shapes(bridge, lora)
    p = "base_model.model.model.layers."
    assert shapes[p + "0.self_attn.q_proj.lora_A.weight"] == (4, 64)
    assert shapes[p + "0.self_attn.q_proj.lora_B.weight"] == (96, 4)
    assert shapes[p + "0.self_attn.k_proj.lora_B.weight"] == (48, 4)
    assert shapes[p + "0.self_attn.o_proj.lora_A.weight"] == (4, 96)
    assert shapes[p + "2.mlp.gate_proj.lora_B.weight"] == (96, 4)
    assert shapes[p + "2.mlp.down_proj.lora_A.weight"] == (4, 96)
    assert shapes[p + "1.mlp.experts.7.up_proj.lora_B.weight"] == (32, 4)
    assert shapes[p + "1.mlp.experts.7.down_proj.lora_B.weight"] == (64, 4)
    assert len(shapes) == 2 * (4 * 4 + 3 + 3 * 8 * 3)
    assert not any(".gate." in k or "router" in k for k in shapes)


def test_target_missing_from_the_model_is_refused(ckpt_dir):
    with pytest.raises(ValueError, match="model.lora.targets: 'dense_mlp', but .* has no dense MLP layers"):
        lora_sites(get_bridge(ckpt_dir["tiny"]), LoraConfig(rank=4, targets=["dense_mlp"]))
    with pytest.raises(ValueError, match="model.lora.targets: 'attention'.*multi-latent attention is not covered"):
        lora_sites(get_bridge(ckpt_dir["deepseek_v3"]), LoraConfig(rank=4, targets=["attention"]))


def _random_adapter(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in sorted(shapes.items())}


@pytest.mark.parametrize("which", ["self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
                                   "experts.local_experts.3.linear_fc1", "experts.local_experts.3.linear_fc2"])
def test_fused_delta_equals_the_hf_modules_lora(ckpt_dir, which):
    """The adapter of a fused megatron linear (TP1) adds exactly the rows of W + s * B_h @ A_h of each HF module
    h, in the weight's row order (q/k/v interleaved by KV group, [gate; up])."""
    from mrl.megatron.lora import LoraAdapter, _TensorReader
    from mrl.megatron.parallel import GroupInfo
    from mrl.megatron.weights import read_shard

    bridge = get_bridge(ckpt_dir["stress_a"])
    lora = LoraConfig(rank=3, alpha=6.0, targets=ALL)
    layer = 2 if which.startswith("mlp.") else 1
    site = next(s for s in lora_sites(bridge, lora) if s.mcore_name == f"decoder.layers.{layer}.{which}.weight"
                or s.mcore_name == f"decoder.layers.{layer}.mlp.{which}.weight")
    # float64: the two sides sum in different orders, and what is checked is the layout, not the rounding
    ad = LoraAdapter(site, scale=lora.scale, group=GroupInfo(None, 0, 1), explicit_comm=False,
                     sequence_parallel=False, dtype=torch.float64, device=torch.device("cpu"), seed=0)
    x = torch.randn(5, 2, site.in_features, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    assert torch.equal(ad.delta(x), torch.zeros(5, 2, site.weight.shape[0], dtype=torch.float64))  # B = 0
    tensors = {k: t.double() for k, t in _random_adapter(site.peft_shapes()).items()}
    reader = _TensorReader(tensors)
    with torch.no_grad():
        ad.A.copy_(read_shard(reader, site.a_map, None, None, torch.float64))
        ad.B.copy_(read_shard(reader, site.b_map, None, None, torch.float64))
    per_module = {h: lora.scale * tensors[peft_name(h, "B")] @ tensors[peft_name(h, "A")] for h in site.hf_modules}
    want = x @ full_from_parts(site.weight, per_module).T
    torch.testing.assert_close(ad.delta(x), want, rtol=1e-10, atol=1e-10)


def test_fresh_adapter_init_is_pefts_and_layout_independent(ckpt_dir):
    from mrl.megatron.lora import LoraAdapter
    from mrl.megatron.parallel import GroupInfo

    bridge = get_bridge(ckpt_dir["stress_a"])
    site = next(s for s in lora_sites(bridge, LoraConfig(rank=4, targets=["attention"]))
                if s.mcore_name.endswith("linear_proj.weight"))
    kw = dict(scale=2.0, explicit_comm=False, sequence_parallel=False, dtype=torch.float32,
              device=torch.device("cpu"), seed=5)
    full = LoraAdapter(site, group=GroupInfo(None, 0, 1), **kw)
    halves = [LoraAdapter(site, group=GroupInfo(None, r, 2), **kw) for r in (0, 1)]
    assert torch.equal(torch.cat([h.A for h in halves], 1), full.A)  # TP2 shards of the same A
    assert full.A.abs().max() <= site.in_features ** -0.5 and not full.B.any()
    assert full.A.requires_grad and full.A.lora_adapter and full.A.partition_dim == 1


def test_merge_and_adapter_directory(tmp_path):
    lora = LoraConfig(rank=2, alpha=3.0, targets=["attention"])
    w = "model.layers.0.self_attn.o_proj.weight"
    hf = {w: torch.randn(6, 4), "model.norm.weight": torch.ones(4)}
    a, b = torch.randn(2, 4), torch.randn(6, 2)
    tensors = {peft_name(w, "A"): a, peft_name(w, "B"): b}
    cfg = peft_config(lora, base_model="/ckpt")
    merged = merge_peft(hf, tensors, cfg)
    torch.testing.assert_close(merged[w], hf[w] + 1.5 * b @ a)
    assert merged["model.norm.weight"] is hf["model.norm.weight"]
    save_peft(str(tmp_path), tensors, cfg)
    got, got_cfg = load_peft(str(tmp_path))
    assert got_cfg == json.loads(json.dumps(cfg)) and all(torch.equal(got[k], tensors[k]) for k in tensors)
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 2 and cfg["lora_alpha"] == 3.0 and cfg["bias"] == "none"
    assert cfg["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"] and not cfg["use_rslora"]


def test_check_peft_refuses_other_adapters():
    lora = LoraConfig(rank=2, alpha=4.0, targets=["attention"])
    shapes = {"base_model.model.x.lora_A.weight": (2, 4), "base_model.model.x.lora_B.weight": (6, 2)}
    t = {k: torch.zeros(s) for k, s in shapes.items()}
    check_peft(t, peft_config(lora), shapes, lora, where="here")
    with pytest.raises(ValueError, match="here: r=3, lora_alpha=4.0, but model.lora has rank=2"):
        check_peft(t, {**peft_config(lora), "r": 3}, shapes, lora, where="here")
    with pytest.raises(ValueError, match="use_rslora=True is not plain LoRA"):
        check_peft(t, {**peft_config(lora), "use_rslora": True}, shapes, lora, where="here")
    with pytest.raises(ValueError, match=r"missing: \['base_model.model.x.lora_B.weight'\]"):
        check_peft({k: v for k, v in t.items() if "lora_A" in k}, peft_config(lora), shapes, lora, where="here")
    with pytest.raises(ValueError, match="mis-shaped"):
        check_peft({**t, "base_model.model.x.lora_B.weight": torch.zeros(5, 2)}, peft_config(lora), shapes, lora,
                   where="here")
    with pytest.raises(FileNotFoundError, match="no adapter_config.json"):
        load_peft("/nonexistent")
