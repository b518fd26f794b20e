"""Which Hugging Face tensors a block-FP8 checkpoint (or an FP8 weight sync) carries in e4m3, and the shape
rules SGLang's block-FP8 loader imposes.

SGLang's ``fp8`` method quantizes exactly its ``LinearBase`` layers and its fused MoE experts
(``Fp8Config.get_quant_method``); every other module keeps the checkpoint's dtype: embeddings and
``lm_head`` (vocab-parallel embeddings, not linear layers), norms, and the MoE router, which the Qwen3-MoE,
GLM-4.5 and DeepSeek-V3 models build without a quant config (``ReplicatedLinear(quant_config=None)`` or a
bare parameter). So the e4m3 tensors are the weights of the attention projections (q/k/v/o; DeepSeek-V3's
MLA q_a/q_b/kv_a_with_mqa/kv_b), the dense MLPs, the routed experts and the shared experts, each with a
``weight_scale_inv`` partner; biases (GLM-4.5's q/k/v), the router's score-correction bias and every other
tensor are written as they are.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

LINEAR_LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                 "gate_proj", "up_proj", "down_proj")
"""Projections SGLang loads into an FP8 linear or fused-MoE layer."""

_TARGET = re.compile(
    r"^model\.layers\.\d+\."
    r"(?:self_attn\.(?P<attn>q_proj|k_proj|v_proj|o_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj)"
    r"|mlp\.(?:experts\.\d+\.|shared_experts?\.)?(?P<mlp>gate_proj|up_proj|down_proj))"
    r"\.weight$")
_ROUTER = re.compile(r"^(model\.layers\.\d+\.mlp\.gate)\.weight$")

# checkpoints list their unquantized modules with these names in both keys (Qwen3 FP8 checkpoints:
# modules_to_not_convert; SGLang reads either)
FUSED_SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def module_matches(ignored: str, module: str) -> bool:
    """``module`` (a dotted path) is ``ignored`` or inside it, matched on whole path components, so that
    ``mlp.gate`` does not match ``mlp.gate_up_proj``: the rule of SGLang's ``is_layer_skipped``."""
    ignored, module = ignored.rstrip("."), module.rstrip(".")
    return module == ignored or module.startswith(ignored + ".") or f".{ignored}." in f".{module}."


def is_fp8_target(name: str, ignored: Sequence[str] = ()) -> bool:
    """True if the HF tensor ``name`` is stored as e4m3 with a ``weight_scale_inv`` partner; ``ignored``:
    module paths kept in high precision on top of the rule (``modules_to_not_convert``)."""
    if not _TARGET.match(name):
        return False
    module = name.removesuffix(".weight")
    return not any(module_matches(i, module) for i in ignored)


def scale_inv_name(name: str) -> str:
    """``...q_proj.weight`` -> ``...q_proj.weight_scale_inv``: the name SGLang's FP8 layers load scales by."""
    if not name.endswith(".weight"):
        raise ValueError(f"{name}: only weights have a block scale")
    return name + "_scale_inv"


def check_fused_groups(names: Iterable[str], ignored: Sequence[str] = ()) -> None:
    """SGLang fuses q/k/v and gate/up into one layer each, and all experts of a layer into one: a group
    quantized in part cannot be loaded ("some but not all shards"). Raises naming the first such group."""
    groups: dict[str, dict[str, bool]] = {}
    for n in names:
        m = _TARGET.match(n)
        if not m:
            continue
        leaf = m.group("attn") or m.group("mlp")
        prefix = n.removesuffix(f"{leaf}.weight")
        if ".experts." in n:  # one fused-MoE layer: every expert's gate, up and down
            key = n[:n.index(".experts.")] + ".experts"
        elif leaf in ("q_proj", "k_proj", "v_proj"):
            key = prefix + "qkv_proj"
        elif leaf in ("gate_proj", "up_proj"):
            key = prefix + "gate_up_proj"
        else:
            key = prefix + leaf
        groups.setdefault(key, {})[n] = is_fp8_target(n, ignored)
    for key, members in groups.items():
        if len(set(members.values())) > 1:
            kept = sorted(n for n, q in members.items() if not q)
            raise ValueError(f"{key}: SGLang loads it as one FP8 layer, but the ignored modules keep only part of "
                             f"it in high precision ({kept[:3]}{' ...' if len(kept) > 3 else ''}); ignore all of it "
                             "or none")


def ignore_problem(hf_dir: str, ignored: Sequence[str]) -> str | None:
    """``check_fused_groups`` of the checkpoint in ``hf_dir`` (its tensor names, from the safetensors
    headers), as one line naming ``engine.fp8_ignore``, or None."""
    from mrl.models.checkpoint import HFCheckpoint

    try:
        check_fused_groups(HFCheckpoint(hf_dir).shapes, ignored)
    except ValueError as e:
        return f"engine.fp8_ignore={list(ignored)}: {e}"
    return None


def modules_to_not_convert(names: Iterable[str], ignored: Sequence[str] = ()) -> list[str]:
    """Linear-shaped modules of the checkpoint left in high precision, for ``quantization_config``: ``lm_head``,
    the routers and what ``ignored`` names. SGLang would not quantize the first two anyway; transformers'
    FP8 loader replaces every ``nn.Linear`` not listed."""
    out = []
    for n in names:
        if n == "lm_head.weight":
            out.append("lm_head")
        elif m := _ROUTER.match(n):
            out.append(m.group(1))
        elif _TARGET.match(n) and not is_fp8_target(n, ignored):
            out.append(n.removesuffix(".weight"))
    return sorted(set(out), key=_natural)


def _natural(s: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def sglang_shape_problems(hf_config: Any, engine_tp: int = 1, engine_ep: int = 1,
                          block_size: tuple[int, int] = (128, 128)) -> list[str]:
    """What SGLang's block-FP8 layers would refuse at load for this model on engines of ``engine_tp`` x
    ``engine_ep`` (``Fp8LinearMethod.validate_block_quant_shapes``, ``Fp8MoEMethod.create_weights``): each
    shard of a fused q/k/v or gate/up layer must be whole row blocks, a row-parallel layer split over TP
    whole column blocks, and an expert's intermediate size per expert-TP rank whole blocks both ways.
    An empty list: it loads. MLA attention (DeepSeek-V3) is left to SGLang, which fuses and splits it
    itself; its MLPs and experts are checked."""
    bn, bk = block_size
    c = hf_config
    tp, moe_tp = engine_tp, max(1, engine_tp // max(1, engine_ep))
    problems = []

    def rows(what: str, size: int) -> None:
        if size % bn:
            problems.append(f"{what} = {size} rows per engine rank is not a multiple of the FP8 block's {bn}")

    def cols(what: str, size: int) -> None:
        if size % bk:
            problems.append(f"{what} = {size} columns per engine rank is not a multiple of the FP8 block's {bk}")

    heads = int(c.num_attention_heads)
    if not getattr(c, "kv_lora_rank", None):  # q/k/v attention (Qwen3-MoE, GLM-4.5)
        d = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
        kv = int(getattr(c, "num_key_value_heads", None) or heads)
        rows("q_proj", heads * d // tp)
        kv_rows = d * max(1, kv // tp)  # SGLang replicates KV heads when TP exceeds them
        rows("k_proj", kv_rows)
        rows("v_proj", kv_rows)
        if tp > 1:
            cols("o_proj", heads * d // tp)
    inter = getattr(c, "intermediate_size", None)
    if inter and _has_dense_layers(c):
        rows("mlp.gate_proj/up_proj (dense layers)", int(inter) // tp)
        if tp > 1:
            cols("mlp.down_proj (dense layers)", int(inter) // tp)
    moe_inter = getattr(c, "moe_intermediate_size", None)
    if moe_inter:
        rows("experts' gate_proj/up_proj", int(moe_inter) // moe_tp)
        if moe_tp > 1:
            cols("experts' down_proj", int(moe_inter) // moe_tp)
        shared = int(getattr(c, "n_shared_experts", 0) or 0)
        if shared:
            rows("shared_experts.gate_proj/up_proj", int(moe_inter) * shared // tp)
            if tp > 1:
                cols("shared_experts.down_proj", int(moe_inter) * shared // tp)
    return problems


def _has_dense_layers(c: Any) -> bool:
    if getattr(c, "first_k_dense_replace", 0):
        return True
    if getattr(c, "mlp_only_layers", None):
        return True
    step = int(getattr(c, "decoder_sparse_step", 1) or 1)
    return step > 1
