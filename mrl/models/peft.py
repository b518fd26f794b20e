"""LoRA adapters in Hugging Face PEFT format: which megatron linears carry one, the PEFT names and shapes of
their factors, ``adapter_config.json``, reading/writing an adapter directory, and merging into HF weights.

Nothing here touches megatron: a site is derived from the bridge's ``ParamMap`` of the base weight, so the
fused megatron linears map onto the separate HF modules exactly as their base weights do. A ``linear_qkv``
site is three HF modules (q, k, v), each with its own ``lora_A`` ``[r, in]`` and ``lora_B`` ``[rows, r]``; its
megatron ``B`` holds the three ``lora_B`` row blocks interleaved like the weight's rows (``ParamMap``
segments and parts), and its ``A`` the three ``lora_A`` stacked. A row-parallel site (``linear_proj``,
``linear_fc2``) is one HF module. Tensor names are PEFT's:
``base_model.model.model.layers.L.self_attn.q_proj.lora_A.weight``,
``base_model.model.model.layers.L.mlp.experts.E.gate_proj.lora_B.weight``.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import torch

from mrl.config.schema import LoraConfig
from mrl.models.bridge import ModelBridge, ParamMap, Part

PEFT_PREFIX = "base_model.model."
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# megatron (local-spec, global) weight names of each target; ``kind``: column-parallel (output rows split
# over TP) or row-parallel (input columns split)
_SITES = {
    "attention": [(re.compile(r"^decoder\.layers\.\d+\.self_attention\.linear_qkv\.weight$"), "column"),
                  (re.compile(r"^decoder\.layers\.\d+\.self_attention\.linear_proj\.weight$"), "row")],
    "dense_mlp": [(re.compile(r"^decoder\.layers\.\d+\.mlp\.linear_fc1\.weight$"), "column"),
                  (re.compile(r"^decoder\.layers\.\d+\.mlp\.linear_fc2\.weight$"), "row")],
    "experts": [(re.compile(r"^decoder\.layers\.\d+\.mlp\.experts\.local_experts\.\d+\.linear_fc1\.weight$"), "column"),
                (re.compile(r"^decoder\.layers\.\d+\.mlp\.experts\.local_experts\.\d+\.linear_fc2\.weight$"), "row")],
}


def peft_name(hf_weight: str, factor: str) -> str:
    """``model.layers.0.self_attn.q_proj.weight``, ``A`` -> ``base_model.model.model.layers.0.self_attn.q_proj.
    lora_A.weight``."""
    if not hf_weight.endswith(".weight"):
        raise ValueError(f"{hf_weight}: not a weight name")
    return f"{PEFT_PREFIX}{hf_weight[:-len('.weight')]}.lora_{factor}.weight"


def base_name(peft: str) -> str:
    """Inverse of ``peft_name``: the HF weight an adapter tensor belongs to."""
    m = re.match(rf"^{re.escape(PEFT_PREFIX)}(.+)\.lora_[AB]\.weight$", peft)
    if m is None:
        raise ValueError(f"{peft!r} is not a PEFT LoRA tensor name ({PEFT_PREFIX}<module>.lora_A/B.weight)")
    return m.group(1) + ".weight"


@dataclass(frozen=True)
class LoraSite:
    """One megatron linear that carries an adapter, with the PEFT layout of its two factors."""

    mcore_name: str
    """Global (TP1/EP1/PP1, local-spec) name of the base weight, e.g. ``decoder.layers.0.self_attention.
    linear_qkv.weight``."""
    kind: str
    """``column`` or ``row``."""
    weight: ParamMap
    """The base weight's map (its rows in HF tensors)."""
    rank: int
    is_expert: bool

    @property
    def hf_modules(self) -> list[str]:
        """HF weight names this linear is made of (q, k, v for ``linear_qkv``; gate, up for ``linear_fc1``)."""
        return self.weight.hf_names

    @property
    def in_features(self) -> int:
        return int(self.weight.num_cols)

    @property
    def a_map(self) -> ParamMap:
        """Megatron ``A``: column sites stack every module's ``lora_A`` ``[r, in]`` (replicated over TP); a row
        site's single ``lora_A`` is split over TP by columns like the weight."""
        return ParamMap(self.mcore_name, ((tuple(Part(peft_name(h, "A"), 0, self.rank) for h in self.hf_modules)),),
                        self.in_features)

    @property
    def b_map(self) -> ParamMap:
        """Megatron ``B``: column sites hold the ``lora_B`` rows laid out as the weight's rows (so TP/ETP splits
        them exactly as it splits the weight); a row site's ``lora_B`` ``[out, r]`` is replicated."""
        segs = tuple(tuple(Part(peft_name(p.hf_name, "B"), p.start, p.stop) for p in seg)
                     for seg in self.weight.segments)
        return ParamMap(self.mcore_name, segs, self.rank)

    def peft_shapes(self) -> dict[str, tuple[int, int]]:
        out: dict[str, tuple[int, int]] = {}
        rows: dict[str, int] = {}
        for seg in self.weight.segments:
            for p in seg:
                rows[p.hf_name] = max(rows.get(p.hf_name, 0), p.stop)
        for h in self.hf_modules:
            out[peft_name(h, "A")] = (self.rank, self.in_features)
            out[peft_name(h, "B")] = (rows[h], self.rank)
        return out


def lora_sites(bridge: ModelBridge, lora: LoraConfig, padded_vocab: int = 0) -> list[LoraSite]:
    """Every adapter site of the model for ``lora.targets``; a ValueError naming ``model.lora.targets`` when a
    target matches nothing in this model (e.g. ``dense_mlp`` on a model without dense layers, ``attention`` on
    multi-latent attention)."""
    sites: list[LoraSite] = []
    maps = bridge.param_maps(padded_vocab or bridge.vocab_size)
    for target in lora.targets:
        found = set()
        for pm in maps:
            for pat, kind in _SITES[target]:
                if pat.match(pm.mcore_name):
                    if pm.num_cols is None or any(p.hf_name is None for seg in pm.segments for p in seg):
                        raise ValueError(f"{pm.mcore_name}: not a plain weight matrix, cannot carry LoRA")
                    if kind == "row" and len(pm.hf_names) != 1:
                        raise ValueError(f"{pm.mcore_name}: a row-parallel linear made of {pm.hf_names}")
                    sites.append(LoraSite(pm.mcore_name, kind, pm, lora.rank, target == "experts"))
                    found.add(kind)
        if found != {"column", "row"}:  # e.g. multi-latent attention has linear_proj but no linear_qkv
            what = {"attention": "q/k/v and o projections (linear_qkv; multi-latent attention is not covered)",
                    "dense_mlp": "dense MLP layers", "experts": "routed experts"}[target]
            raise ValueError(f"model.lora.targets: {target!r}, but {bridge.path or type(bridge).__name__} has no "
                             f"{what}")
    return sites


def peft_shapes(bridge: ModelBridge, lora: LoraConfig) -> dict[str, tuple[int, int]]:
    """Name -> shape of every tensor of this model's adapter (what an export holds, what an import needs)."""
    out: dict[str, tuple[int, int]] = {}
    for s in lora_sites(bridge, lora):
        out.update(s.peft_shapes())
    return out


def peft_config(lora: LoraConfig, *, base_model: str | None = None) -> dict:
    """``adapter_config.json`` of an mrl adapter: plain LoRA, scaling ``lora_alpha / r`` (what SGLang applies)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(lora.rank), "lora_alpha": float(lora.alpha),
            "target_modules": list(lora.hf_target_modules), "lora_dropout": 0.0, "bias": "none",
            "use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "modules_to_save": None,
            "base_model_name_or_path": base_model}


def check_peft(tensors: dict[str, torch.Tensor], config: dict, shapes: dict[str, tuple[int, int]], lora: LoraConfig,
               *, where: str) -> None:
    """Refuse an adapter that is not this model's at ``lora``'s rank and alpha, naming ``where``."""
    r, alpha = config.get("r"), config.get("lora_alpha")
    if r != lora.rank or alpha is None or float(alpha) != float(lora.alpha):
        raise ValueError(f"{where}: r={r}, lora_alpha={alpha}, but model.lora has rank={lora.rank}, "
                         f"alpha={lora.alpha}")
    for k in ("use_rslora", "use_dora", "rank_pattern", "alpha_pattern"):
        if config.get(k):
            raise ValueError(f"{where}: {k}={config[k]!r} is not plain LoRA (mrl trains and SGLang serves "
                             "W + alpha/r * B @ A only)")
    missing = sorted(set(shapes) - set(tensors))
    extra = sorted(set(tensors) - set(shapes))
    bad = sorted(k for k in set(shapes) & set(tensors) if tuple(tensors[k].shape) != tuple(shapes[k]))
    if missing or extra or bad:
        raise ValueError(f"{where}: not an adapter of this model for model.lora.targets: "
                         + "; ".join(f"{what}: {keys[:4]}{' ...' if len(keys) > 4 else ''}"
                                     for what, keys in (("missing", missing), ("unexpected", extra), ("mis-shaped", [
                                         f"{k} {list(tensors[k].shape)} != {list(shapes[k])}" for k in bad]))
                                     if keys))


def save_peft(path: str, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """Write an adapter directory: ``adapter_model.safetensors`` + ``adapter_config.json``."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, os.path.join(path, WEIGHTS_FILE),
              metadata={"format": "pt"})
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=1)


def load_peft(path: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, config) of an adapter directory."""
    from safetensors.torch import load_file

    for fn in (CONFIG_FILE, WEIGHTS_FILE):
        if not os.path.isfile(os.path.join(path, fn)):
            raise FileNotFoundError(f"{path}: no {fn}; an HF PEFT adapter directory holds {CONFIG_FILE} and "
                                    f"{WEIGHTS_FILE}")
    with open(os.path.join(path, CONFIG_FILE)) as f:
        config = json.load(f)
    return load_file(os.path.join(path, WEIGHTS_FILE)), config


def merge_peft(hf: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """HF weights (per-expert names) with the adapter folded in: ``W + lora_alpha / r * B @ A`` (computed in
    float64, stored in W's dtype). For checks and final checkpoints; rollouts get the adapter itself."""
    scale = float(config["lora_alpha"]) / int(config["r"])
    out = dict(hf)
    for k, a in tensors.items():
        if ".lora_A." not in k:
            continue
        w = base_name(k)
        if w not in hf:
            raise KeyError(f"{k}: the base model has no {w}")
        b = tensors[k.replace(".lora_A.", ".lora_B.")]
        out[w] = (hf[w].double() + scale * (b.double() @ a.double())).to(hf[w].dtype)
    return out
