"""Random Qwen3-MoE HF checkpoints of any size, written tensor by tensor (``bench/gpu_loop.py``).

    python bench/_random_checkpoint.py DIR --shape qwen3_30b_a3b [--layers 12] [--seed 0]

No model is instantiated: each tensor is drawn on its own (on the GPU where there is one), cast to
bf16 and written into safetensors shards of about ``--shard-gb`` with a
``model.safetensors.index.json``, so the full Qwen3-30B-A3B shape (30.5B parameters, 61 GB) needs one
shard of host memory, not the model's. Values follow transformers' init: matrices normal(0, 0.02),
norms 1. Tensor ``name`` is drawn from a generator seeded with ``crc32(f"{seed}:{name}")``
(``mrl.models.synthetic``), so a checkpoint is the same on every run on the same kind of device (CPU and
CUDA generators differ) and equals the weights ``SyntheticWeights`` draws without any file.
Names are the hub's per-expert names, which SGLang requires.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from mrl.models.synthetic import synthetic_tensor

# Qwen3-MoE shapes; "probe" is the 2.4 GB bf16 model the SGLang GPU measurements used (hidden 1024,
# 8 layers, 64 experts top-8, vocab 32768), "qwen3_30b_a3b" the real model (48 layers; cut with --layers).
SHAPES = {
    # mrl's ``tiny`` preset's shape: what ``gpu_loop.py --cpu`` runs
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2),
    # many experts on CPU (``gpu_loop.py --cpu --cpu-model cpu_wide``): per-tensor and per-bucket costs show
    "cpu_wide": dict(vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=64,
                     num_experts_per_tok=4),
    "probe": dict(vocab_size=32768, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=704,
                  num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=128, num_experts=64,
                  num_experts_per_tok=8),
    "qwen3_30b_a3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8),
}


def tensor_shapes(kw: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a Qwen3-MoE checkpoint (all layers MoE, untied head), in file order."""
    h, hd, v = kw["hidden_size"], kw["head_dim"], kw["vocab_size"]
    q, kv, inter = kw["num_attention_heads"] * hd, kw["num_key_value_heads"] * hd, kw["moe_intermediate_size"]
    out = [("model.embed_tokens.weight", (v, h))]
    for i in range(kw["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out += [(f"{p}.input_layernorm.weight", (h,)), (f"{p}.post_attention_layernorm.weight", (h,)),
                (f"{p}.self_attn.q_proj.weight", (q, h)), (f"{p}.self_attn.k_proj.weight", (kv, h)),
                (f"{p}.self_attn.v_proj.weight", (kv, h)), (f"{p}.self_attn.o_proj.weight", (h, q)),
                (f"{p}.self_attn.q_norm.weight", (hd,)), (f"{p}.self_attn.k_norm.weight", (hd,)),
                (f"{p}.mlp.gate.weight", (kw["num_experts"], h))]
        for e in range(kw["num_experts"]):
            out += [(f"{p}.mlp.experts.{e}.gate_proj.weight", (inter, h)),
                    (f"{p}.mlp.experts.{e}.up_proj.weight", (inter, h)),
                    (f"{p}.mlp.experts.{e}.down_proj.weight", (h, inter))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


def config(kw: dict):
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(architectures=["Qwen3MoeForCausalLM"], bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, tie_word_embeddings=False,
                         rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=4096, **kw)
    cfg.dtype = "bfloat16"
    return cfg


def write_checkpoint(path: str, kw: dict, seed: int = 0, shard_gb: float = 4.0, device: str | None = None) -> str:
    """Write the checkpoint of Qwen3-MoE shape ``kw`` to ``path`` (kept if its config.json exists: it is
    written last, so a checkpoint cut short is made again)."""
    from safetensors.torch import save_file

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    os.makedirs(path, exist_ok=True)
    names = tensor_shapes(kw)
    per = int(shard_gb * (1 << 30))
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in names:
        n = 2 * int(torch.Size(shape).numel())
        if shards[-1] and size + n > per:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += n
    weight_map, total = {}, 0
    for k, items in enumerate(shards):
        fn = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        sd = {}
        for name, shape in items:
            t = synthetic_tensor(name, shape, seed=seed, device=device).cpu()  # what SyntheticWeights draws
            sd[name] = t
            weight_map[name] = fn
            total += t.numel() * 2
        save_file(sd, os.path.join(path, fn), metadata={"format": "pt"})
        del sd
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    config(kw).save_pretrained(path)
    return path


def shape_kw(shape: str, layers: int | None) -> dict:
    """``SHAPES[shape]`` cut to ``layers`` layers (all of them when None)."""
    if shape not in SHAPES:
        raise ValueError(f"--model: unknown shape {shape!r} (one of {sorted(SHAPES)})")
    kw = dict(SHAPES[shape])
    if layers:
        kw["num_hidden_layers"] = layers
    return kw


def make_config_dir(path: str, shape: str, layers: int | None) -> str:
    """Only the ``config.json`` of ``shape`` at ``path``: the weights come from ``mrl.models.synthetic``
    (no checkpoint on disk; the full 48-layer model's 61 GB would not fit beside the stack)."""
    os.makedirs(path, exist_ok=True)
    config(shape_kw(shape, layers)).save_pretrained(path)
    return path


def make_checkpoint(path: str, shape: str, layers: int | None, seed: int = 0, shard_gb: float = 4.0) -> str:
    """``SHAPES[shape]`` cut to ``layers`` layers (all of them when None) at ``path``."""
    return write_checkpoint(path, shape_kw(shape, layers), seed=seed, shard_gb=shard_gb)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("path")
    ap.add_argument("--shape", default="probe", choices=list(SHAPES))
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard-gb", type=float, default=4.0)
    a = ap.parse_args()
    print(make_checkpoint(a.path, a.shape, a.layers, a.seed, a.shard_gb))
