"""What each tensor-parallel rank of an SGLang Qwen3-MoE engine holds, built from full HF tensors.

The bitwise check of ``bench/_live_sync_worker.py`` hashes these with SGLang's own ``tensor_hash`` and
compares them with the engine's ``/weights_checker`` checksums, rank by rank. SGLang's layout for
Qwen3-MoE (unquantized, no AMX repacking):

- replicated: norms (``input_layernorm``, ``post_attention_layernorm``, ``q_norm``, ``k_norm``,
  ``model.norm``) and the router (``mlp.gate``, a ``ReplicatedLinear``);
- ``embed_tokens`` / ``lm_head``: vocabulary rows split in ``tp`` equal parts (checked only where the
  vocabulary needs no padding to split evenly: padded rows are not the trainer's);
- ``qkv_proj``: this rank's query heads, then its key and value heads (kv heads replicated when there
  are fewer than ``tp``);
- ``o_proj``: input columns split in ``tp`` parts;
- ``experts.w13_weight`` ``[E, 2 I/tp, H]``: per expert this rank's rows of ``gate_proj`` then of
  ``up_proj``; ``experts.w2_weight`` ``[E, H, I/tp]``: this rank's columns of ``down_proj``. SGLang's CPU
  engine pads each rank's part to the full I instead: both layouts are candidates
  (``expert_layouts``), and the check says which one matched.
"""

from __future__ import annotations

import re

import torch

_REPLICATED = re.compile(r"(.*(layernorm|q_norm|k_norm)\.weight|model\.norm\.weight|.*\.mlp\.gate\.weight)$")
_VOCAB_PAD = 64  # SGLang's DEFAULT_VOCAB_PADDING_SIZE: each rank's vocabulary rows are a multiple of it


def sampled_names(num_layers: int) -> list[str]:
    """Engine parameter names to check: the first and the last layer in full (experts included), the
    embeddings, the final norm and the head."""
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in sorted({0, num_layers - 1}):
        p = f"model.layers.{i}"
        names += [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight",
                  f"{p}.self_attn.qkv_proj.weight", f"{p}.self_attn.o_proj.weight", f"{p}.self_attn.q_norm.weight",
                  f"{p}.self_attn.k_norm.weight", f"{p}.mlp.gate.weight", f"{p}.mlp.experts.w13_weight",
                  f"{p}.mlp.experts.w2_weight"]
    return names


def engine_shard(hf: dict[str, torch.Tensor], name: str, tp: int, rank: int, *, num_experts: int, kv_heads: int,
                 head_dim: int) -> torch.Tensor | None:
    """The tensor engine TP rank ``rank`` of ``tp`` holds under ``name``, from the full HF tensors ``hf``
    (None where it cannot be derived exactly: vocabulary padding)."""
    if _REPLICATED.match(name):
        return hf[name]
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        v = hf[name].shape[0]
        if v % (tp * _VOCAB_PAD):
            return None
        return hf[name].chunk(tp, 0)[rank]
    m = re.match(r"(model\.layers\.\d+)\.(self_attn\.qkv_proj|self_attn\.o_proj|mlp\.experts\.w13_weight|"
                 r"mlp\.experts\.w2_weight)", name)
    if not m:
        raise ValueError(f"engine_shard: no rule for {name!r}")
    p, kind = m.group(1), m.group(2)
    if kind == "self_attn.o_proj":
        return hf[f"{p}.self_attn.o_proj.weight"].chunk(tp, 1)[rank]
    if kind == "self_attn.qkv_proj":
        q = hf[f"{p}.self_attn.q_proj.weight"].chunk(tp, 0)[rank]
        nkv, hd = kv_heads, head_dim
        kv = []
        for proj in ("k_proj", "v_proj"):
            w = hf[f"{p}.self_attn.{proj}.weight"]
            if nkv >= tp:
                kv.append(w.chunk(tp, 0)[rank])
            else:  # each rank holds one kv head, shared by tp // nkv ranks
                h = rank * nkv // tp
                kv.append(w[h * hd:(h + 1) * hd])
        return torch.cat([q, *kv], 0)
    return expert_layouts(hf, p, kind, tp, rank, num_experts)["tp"]


def expert_layouts(hf: dict[str, torch.Tensor], prefix: str, kind: str, tp: int, rank: int,
                   num_experts: int) -> dict[str, torch.Tensor]:
    """A layer's fused expert tensor as TP rank ``rank`` holds it, in each layout SGLang uses: ``"tp"``,
    each rank's part of the experts' intermediate size I/tp (GPU engines); ``"padded"``, each rank's part
    padded to the full I (SGLang's CPU MoE: rank 0 then holds every expert whole and the other ranks
    zeros, which add nothing to the all-reduce)."""
    def part(w: torch.Tensor, dim: int, width: int) -> torch.Tensor:
        rows = w.narrow(dim, min(rank * width, w.shape[dim]), max(0, min(width, w.shape[dim] - rank * width)))
        pad = list(w.shape)
        pad[dim] = width - rows.shape[dim]
        return torch.cat([rows, w.new_zeros(pad)], dim)

    def fused(width: int) -> torch.Tensor:
        if kind == "mlp.experts.w13_weight":
            return torch.stack([torch.cat([part(hf[f"{prefix}.mlp.experts.{e}.gate_proj.weight"], 0, width),
                                           part(hf[f"{prefix}.mlp.experts.{e}.up_proj.weight"], 0, width)], 0)
                                for e in range(num_experts)])
        return torch.stack([part(hf[f"{prefix}.mlp.experts.{e}.down_proj.weight"], 1, width)
                            for e in range(num_experts)])

    inter = hf[f"{prefix}.mlp.experts.0.down_proj.weight"].shape[1]
    out = {"tp": fused(inter // tp)}
    if tp > 1:
        out["padded"] = fused(inter)
    return out


def fp8_checker_view(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """What SGLang's weight checker hashes for a block-FP8 weight: not its e4m3 bytes (nor its
    ``weight_scale_inv``, which it leaves out) but the two dequantized to bf16 with 128x128 blocks, by its
    own ``block_quant_dequant``. ``q``/``scale_inv`` as the engine rank holds them (fused, stacked)."""
    from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant

    return block_quant_dequant(q, scale_inv, [128, 128], torch.bfloat16)

