"""``mrl make-tiny-model DIR``: tiny random Qwen3-MoE HF checkpoints and a tokenizer, made locally.

Nothing is downloaded. The default ``tiny`` preset is the model of tests and of ``mrl train``; the
two stress presets catch mapping mistakes the tiny one cannot (head_dim != hidden/heads, rope theta
!= megatron's default, dense layers, vocab padding, tied embeddings, norm_topk_prob off).
Weights are written with per-expert hub names, which SGLang 0.5.10 requires.
"""

from __future__ import annotations

import os
import re

import torch

from mrl.config.schema import TinyPreset

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]  # ids 0..3; bos=1, eos=2

PRESETS: dict[TinyPreset, dict] = {
    TinyPreset.tiny: dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, tie_word_embeddings=False,
        rope_theta=10000.0, rms_norm_eps=1e-6),
    TinyPreset.stress_a: dict(
        vocab_size=500, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_experts=8, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=[2], norm_topk_prob=True, tie_word_embeddings=False,
        rope_theta=1000000.0, rms_norm_eps=1e-6),
    TinyPreset.stress_b: dict(
        vocab_size=300, hidden_size=64, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=12, num_experts=16, num_experts_per_tok=4,
        decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=False, tie_word_embeddings=True,
        rope_theta=5000.0, rms_norm_eps=1e-5),
}


def split_fused_experts(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers-5 fused experts ([E, 2I, H] gate first, [E, H, I]) -> per-expert hub names."""
    out = {}
    for k, v in sd.items():
        m = re.match(r"(.*\.mlp\.experts\.)(gate_up_proj|down_proj)$", k)
        if not m:
            out[k] = v
            continue
        for e in range(v.shape[0]):
            if m.group(2) == "gate_up_proj":
                gate, up = v[e].chunk(2, 0)
                out[f"{m.group(1)}{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{m.group(1)}{e}.up_proj.weight"] = up.contiguous()
            else:
                out[f"{m.group(1)}{e}.down_proj.weight"] = v[e].contiguous()
    return out


def build_tokenizer(vocab_size: int):
    """Byte-level BPE trained on a small synthetic corpus (digits, letters, arithmetic, words).

    Deterministic: the corpus is generated from a fixed seed. Vocab = 4 specials + 256 bytes + merges.
    """
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    words = ["reverse", "sort", "sum", "copy", "answer", "the", "of", "is", "add", "list", "count", "number"]
    corpus = []
    for _ in range(4000):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        w = rng.choice(words)
        letters = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 8)))
        corpus.append(f"{w} {letters} {a}+{b}={a + b} {' '.join(letters)}")
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def make_tiny_model(out_dir: str, preset: TinyPreset = TinyPreset.tiny, seed: int = 0) -> str:
    """Write a random Qwen3-MoE checkpoint + tokenizer.json to ``out_dir``; returns ``out_dir``."""
    from safetensors.torch import save_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    kw = dict(PRESETS[TinyPreset(preset)])
    cfg = Qwen3MoeConfig(max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         architectures=["Qwen3MoeForCausalLM"], **kw)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).to(torch.float32)
    if preset != TinyPreset.tiny:
        # HF inits norms to 1 and weights with std 0.02, which hides swapped norms and mapping
        # mistakes; stress presets use random norms and fan-in scaled weights, routers 2x.
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for n, p in model.named_parameters():
                r = torch.randn(p.shape, generator=g)
                if "norm" in n:
                    p.copy_(1.0 + 0.3 * r)
                elif "embed_tokens" in n:
                    p.copy_(r)
                else:
                    p.copy_(r * (2.0 if n.endswith("mlp.gate.weight") else 1.0) / p.shape[-1] ** 0.5)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    for f in os.listdir(out_dir):  # rewrite weights with per-expert names
        if f.endswith(".safetensors") or f == "model.safetensors.index.json":
            os.remove(os.path.join(out_dir, f))
    sd = split_fused_experts({k: v.detach() for k, v in model.state_dict().items()})
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})
    tok = build_tokenizer(cfg.vocab_size)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    return out_dir
