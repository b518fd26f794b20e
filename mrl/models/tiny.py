"""``mrl make-tiny-model DIR``: tiny random HF checkpoints and a tokenizer, made locally.

Nothing is downloaded. The default ``tiny`` preset (Qwen3-MoE) is the model of tests and of
``mrl train``; the two stress presets catch mapping mistakes the tiny one cannot (head_dim !=
hidden/heads, rope theta != megatron's default, dense layers, vocab padding, tied embeddings,
norm_topk_prob off). The family presets (``glm4_moe``, ...) are the smallest checkpoints of those
architectures that still exercise every mapped feature; transformers' zero init of biases and of the
score-correction bias is replaced by random values so a dropped or misplaced one shows.
Weights are written with per-expert hub names, which SGLang requires.
"""

from __future__ import annotations

import os
import re

import torch

from mrl.config.schema import TinyPreset

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]  # ids 0..3; bos=1, eos=2
TINY_CONTEXT = 2048
"""``max_position_embeddings`` of every tiny checkpoint."""

PRESETS: dict[TinyPreset, dict] = {
    TinyPreset.tiny: dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, tie_word_embeddings=False,
        rope_theta=10000.0, rms_norm_eps=1e-6),
    # SGLang's fused GPU rope/KV-cache kernels need a head_dim of 64 or more
    TinyPreset.tiny_gpu: dict(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, tie_word_embeddings=False,
        rope_theta=10000.0, rms_norm_eps=1e-6),
    # large enough that a GPU run is not all launch overhead, small enough to learn a task from scratch in minutes
    TinyPreset.small_gpu: dict(
        vocab_size=512, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=32, num_experts_per_tok=4,
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
    TinyPreset.glm4_moe: dict(
        vocab_size=500, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, routed_scaling_factor=2.5, n_group=1, topk_group=1, first_k_dense_replace=1,
        norm_topk_prob=True, use_qk_norm=True, attention_bias=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
        rms_norm_eps=1e-5),
    TinyPreset.deepseek_v3: dict(
        vocab_size=500, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        routed_scaling_factor=2.5, n_group=2, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
        tie_word_embeddings=False, rms_norm_eps=1e-6,
        # YaRN as in DeepSeek-V3 (factor 40 there); SGLang's CPU rope supports only this kind
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 512, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
        # what SGLang reads beyond transformers' config class (real DeepSeek-V3 configs carry them)
        moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid"),
}
PRESETS[TinyPreset.tiny_lora] = PRESETS[TinyPreset.tiny]
LORA_HEAD_SCALE = 10.0
"""``tiny_lora``: the tiny model (same seed, same weights) with ``lm_head`` scaled to std 0.2. LoRA freezes
the head and the final norm, and at HF's init (std 0.02) they bound every logit by |w| * sqrt(hidden) ~ 1.3,
which caps any token's probability near 1% over 512 tokens: no adapter could make the model answer. A
trained model's head is not that flat; with this one adapters on attention alone learn copy_last."""

# preset -> (transformers config class, model class, architecture)
_QWEN3 = ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")
FAMILIES: dict[TinyPreset, tuple[str, str]] = {
    TinyPreset.tiny: _QWEN3, TinyPreset.tiny_gpu: _QWEN3, TinyPreset.small_gpu: _QWEN3,
    TinyPreset.stress_a: _QWEN3, TinyPreset.stress_b: _QWEN3,
    TinyPreset.tiny_lora: _QWEN3,
    TinyPreset.glm4_moe: ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
    TinyPreset.deepseek_v3: ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
}
_STRESS = (TinyPreset.stress_a, TinyPreset.stress_b)


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
    """Write a random checkpoint of ``preset`` + tokenizer.json to ``out_dir``; returns ``out_dir``."""
    import transformers
    from safetensors.torch import save_file

    preset = TinyPreset(preset)
    config_cls, model_cls = (getattr(transformers, n) for n in FAMILIES[preset])
    cfg = config_cls(max_position_embeddings=TINY_CONTEXT, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                     architectures=[model_cls.__name__], **PRESETS[preset])
    torch.manual_seed(seed)
    model = model_cls(cfg).to(torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    if preset in _STRESS:
        # HF inits norms to 1 and weights with std 0.02, which hides swapped norms and mapping
        # mistakes; stress presets use random norms and fan-in scaled weights, routers 2x.
        with torch.no_grad():
            for n, p in model.named_parameters():
                r = torch.randn(p.shape, generator=g)
                if "norm" in n:
                    p.copy_(1.0 + 0.3 * r)
                elif "embed_tokens" in n:
                    p.copy_(r)
                else:
                    p.copy_(r * (2.0 if n.endswith("mlp.gate.weight") else 1.0) / p.shape[-1] ** 0.5)
    elif preset == TinyPreset.tiny_lora:
        with torch.no_grad():
            model.lm_head.weight.mul_(LORA_HEAD_SCALE)
    elif FAMILIES[preset] != _QWEN3:
        # family presets keep HF's init (they must train like the tiny one) but no tensor is left at a
        # constant: norms around 1, biases small, the score-correction bias on the scale of the router
        # scores' spread so that it changes some selections
        with torch.no_grad():
            for n, t in model.state_dict(keep_vars=True).items():
                r = torch.randn(t.shape, generator=g)
                if n.endswith("norm.weight"):
                    t.copy_(1.0 + 0.2 * r)
                elif n.endswith(".bias"):
                    t.copy_(0.02 * r)
                elif n.endswith("e_score_correction_bias"):
                    t.copy_(0.01 * r)
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


def check_preset(path: str, preset: TinyPreset) -> None:
    """A checkpoint already at ``path`` must be of ``preset``'s architecture: ``model.tiny_preset`` names
    the family the run expects, and an old directory of another family would otherwise be trained as is."""
    from mrl.models.bridge import read_config_json

    have = read_config_json(path).get("architectures") or []
    want = FAMILIES[TinyPreset(preset)][1]
    if want not in have:
        raise ValueError(f"model.hf_path={path} holds a {have} checkpoint but model.tiny_preset="
                         f"{TinyPreset(preset).value} is {want}: point model.hf_path elsewhere or delete it")



def make_tiny_reward_model(out_dir: str, seed: int = 0, *, score_std: float = 1.0) -> str:
    """Write a random one-label ``Qwen3ForSequenceClassification`` (dense, the tiny preset's attention shapes) with
    the tiny tokenizer to ``out_dir``: a reward model SGLang serves on its classification path (``/classify``),
    for tests and CPU recipes. The score head is drawn with ``score_std`` (HF's 0.02 would make every score
    nearly 0). Returns ``out_dir``."""
    import transformers

    p = PRESETS[TinyPreset.tiny]
    cfg = transformers.Qwen3Config(
        vocab_size=p["vocab_size"], hidden_size=p["hidden_size"], intermediate_size=p["intermediate_size"],
        num_hidden_layers=2, num_attention_heads=p["num_attention_heads"], head_dim=p["head_dim"],
        num_key_value_heads=p["num_key_value_heads"], rope_theta=p["rope_theta"], rms_norm_eps=p["rms_norm_eps"],
        max_position_embeddings=TINY_CONTEXT, bos_token_id=1, eos_token_id=2, pad_token_id=0, num_labels=1,
        tie_word_embeddings=False, architectures=["Qwen3ForSequenceClassification"])
    torch.manual_seed(seed)
    model = transformers.Qwen3ForSequenceClassification(cfg).to(torch.float32)
    with torch.no_grad():
        model.score.weight.normal_(0.0, score_std, generator=torch.Generator().manual_seed(seed + 1))
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    build_tokenizer(cfg.vocab_size).save(os.path.join(out_dir, "tokenizer.json"))
    return out_dir
