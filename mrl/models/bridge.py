"""HF <-> Megatron bridge interface and the layout-independent mapping machinery.

A bridge (one file per architecture, e.g. ``qwen3_moe.py``) says three things:
1. the megatron ``TransformerConfig`` fields and ``GPTModel`` arguments for an HF config;
2. for every megatron parameter at TP1/EP1/PP1 (its *global* name), how its rows are made of HF
   tensors: a ``ParamMap`` of dim-0 ``segments``, each a list of ``Part``s (rows of one HF tensor, or
   zero rows for vocab padding);
3. nothing else: slicing for TP/ETP/EP/PP, import with per-rank slice reads and export are generic
   (``mrl/models/load.py``, ``mrl/models/export.py``).

Why segments: megatron shards dim 0 of each segment separately. A SwiGLU ``linear_fc1`` is two
segments ``[gate]`` and ``[up]``, so TP rank r holds ``cat(gate.chunk(tp)[r], up.chunk(tp)[r])``;
``linear_qkv`` is one segment whose rows interleave q/k/v by KV group, so a contiguous TP chunk is
whole groups.
"""

from __future__ import annotations

import json
import os
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:  # torch is imported where tensors are made: the preflight names tensors without it (seconds)
    import torch


@dataclass(frozen=True)
class Part:
    """Rows ``[start, stop)`` of HF tensor ``hf_name`` (all columns); ``hf_name=None`` means zero rows."""

    hf_name: str | None
    start: int
    stop: int

    @property
    def num_rows(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class ParamMap:
    """How one global megatron parameter is assembled from HF tensors."""

    mcore_name: str
    segments: tuple[tuple[Part, ...], ...]
    num_cols: int | None
    """Second dim of the full tensor; None for 1-D tensors (norm weights)."""

    @property
    def hf_names(self) -> list[str]:
        seen: list[str] = []
        for seg in self.segments:
            for p in seg:
                if p.hf_name is not None and p.hf_name not in seen:
                    seen.append(p.hf_name)
        return seen

    @property
    def shape(self) -> tuple[int, ...]:
        rows = sum(p.num_rows for seg in self.segments for p in seg)
        return (rows,) if self.num_cols is None else (rows, self.num_cols)


def copy(mcore: str, hf: str, shape: tuple[int, ...]) -> ParamMap:
    """Megatron param equal to one HF tensor."""
    return ParamMap(mcore, ((Part(hf, 0, shape[0]),),), shape[1] if len(shape) > 1 else None)


def concat(mcore: str, hfs: list[tuple[str, int]], num_cols: int) -> ParamMap:
    """Megatron param = separately sharded segments, one per HF tensor (SwiGLU [gate; up])."""
    return ParamMap(mcore, tuple((Part(n, 0, rows),) for n, rows in hfs), num_cols)


def padded_rows(mcore: str, hf: str, rows: int, padded: int, num_cols: int) -> ParamMap:
    """Vocab-parallel param: HF rows then zero rows up to the padded vocabulary."""
    parts = [Part(hf, 0, rows)] + ([Part(None, 0, padded - rows)] if padded > rows else [])
    return ParamMap(mcore, (tuple(parts),), num_cols)


# Transformer Engine spec names -> local-spec names (the bridges speak local-spec names). TE fuses the
# input norm into linear_qkv and a dense layer's pre-MLP norm into linear_fc1, and TEGroupedMLP keeps
# one weight per local expert as ``linear_fc{1,2}.weight{e}`` (checked on GPUs: tests/gpu/parity.sh with TE).
_TE_NAMES = [
    (re.compile(r"\.self_attention\.linear_qkv\.layer_norm_weight$"), ".input_layernorm.weight"),
    (re.compile(r"\.mlp\.linear_fc1\.layer_norm_weight$"), ".pre_mlp_layernorm.weight"),
    (re.compile(r"\.mlp\.experts\.linear_fc([12])\.weight(\d+)$"), r".mlp.experts.local_experts.\2.linear_fc\1.weight"),
]


def local_spec_name(name: str) -> str:
    for pat, repl in _TE_NAMES:
        name = pat.sub(repl, name)
    return name


class UnsupportedModelError(ValueError):
    pass


class ModelBridge(ABC):
    """Maps one HF architecture onto megatron-core's GPTModel."""

    architectures: ClassVar[tuple[str, ...]]

    def __init__(self, hf_config: Any, path: str | None = None):
        self.hf_config = hf_config
        self.path = path
        self.validate()

    # -- what each architecture file provides ---------------------------------------------------
    def validate(self) -> None:
        """Raise UnsupportedModelError for config values the mapping does not cover."""

    @abstractmethod
    def transformer_config_kwargs(self) -> dict[str, Any]:
        """``TransformerConfig`` fields that come from the HF config."""

    @abstractmethod
    def gpt_model_kwargs(self, padded_vocab: int) -> dict[str, Any]:
        """``GPTModel`` arguments that come from the HF config (rope settings live here, not in the config)."""

    @abstractmethod
    def param_maps(self, padded_vocab: int) -> list[ParamMap]:
        """One ParamMap per global megatron parameter."""

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def num_experts(self) -> int: ...

    @property
    @abstractmethod
    def num_layers(self) -> int: ...

    @property
    @abstractmethod
    def num_query_groups(self) -> int: ...

    @abstractmethod
    def moe_layer_pattern(self) -> list[int]:
        """Per layer 1 (MoE) or 0 (dense): megatron's ``moe_layer_freq`` list, and which layers of an
        engine's routed-experts record are kept."""

    def engine_config(self) -> dict[str, Any]:
        """config.json keys an inference engine needs beyond what transformers' config class keeps;
        exported checkpoints get those that are missing."""
        return {}

    def skipped_hf_tensors(self, names) -> list[str]:
        """Checkpoint tensors that are not part of the trained model and are skipped on import (named in
        a log line), e.g. DeepSeek-V3's multi-token-prediction layers."""
        return []

    @property
    def tied_embeddings(self) -> bool:
        return bool(getattr(self.hf_config, "tie_word_embeddings", False))

    # -- shared helpers ------------------------------------------------------------------------
    def padded_vocab(self, divisible_by: int, tp: int) -> int:
        """megatron.training's rule: pad to a multiple of divisible_by * tp (pad rows are zero)."""
        m = divisible_by * tp
        return -(-self.vocab_size // m) * m

    def hf_tensor_shapes(self, padded_vocab: int) -> dict[str, tuple[int, ...]]:
        """Every HF tensor the checkpoint must hold, with its shape (derived from the maps)."""
        shapes: dict[str, list[int]] = {}
        for pm in self.param_maps(padded_vocab):
            for seg in pm.segments:
                for p in seg:
                    if p.hf_name is None:
                        continue
                    rows = shapes.setdefault(p.hf_name, [0] + ([pm.num_cols] if pm.num_cols else []))
                    rows[0] = max(rows[0], p.stop)
        return {k: tuple(v) for k, v in shapes.items()}


def read_config_json(path: str) -> dict:
    f = os.path.join(path, "config.json")
    if not os.path.isfile(f):
        raise FileNotFoundError(f"{f}: no config.json; model.hf_path must be a Hugging Face checkpoint directory")
    with open(f) as fh:
        return json.load(fh)


class ConfigNeedsTransformers(Exception):
    """A bridge read a key that config.json lacks, or holds as a string or a real where a bridge reads
    neither: transformers' config class would give its own default there, or refuse the type, so ask it (not
    an AttributeError, which ``getattr(c, key, default)`` would turn into the bridge's default)."""


class JsonConfig:
    """config.json's values as attributes, for a bridge that names tensors and checks settings without
    transformers (its config machinery imports torch: seconds, what the preflight must not spend).

    Where a key is absent, only the keys of ``ABSENT_OK`` read as absent (the bridge's own default applies);
    any other raises ConfigNeedsTransformers, and the caller builds transformers' config instead. So does a
    string or a real value of a key not in ``TEXT_OR_REAL`` (vocab_size "512": transformers checks the types).
    tests/unit/test_bridge_json_config.py holds these against transformers' config classes."""

    ABSENT_OK = frozenset({
        "rope_scaling", "rope_parameters",  # the bridges merge both spellings of the rope settings
        "num_experts",  # Qwen3-MoE's other name of num_local_experts, which the bridge reads next
        "pad_token_id",  # None in every mapped config class
    })
    TEXT_OR_REAL = {"hidden_act": str, "scoring_func": str, "topk_method": str, "rms_norm_eps": float,
                    "rope_theta": float, "attention_dropout": float, "routed_scaling_factor": float,
                    "partial_rotary_factor": float}

    def __init__(self, raw: dict):
        self._raw = raw

    def __getattr__(self, key: str):
        if key.startswith("_"):
            raise AttributeError(key)
        if key in self._raw:
            value = self._raw[key]
            if isinstance(value, (str, float)) and not isinstance(value, self.TEXT_OR_REAL.get(key, ())):
                raise ConfigNeedsTransformers(key)
            return value
        if key in self.ABSENT_OK:
            raise AttributeError(key)
        raise ConfigNeedsTransformers(key)


def full_from_parts(pm: ParamMap, hf: dict[str, torch.Tensor]) -> torch.Tensor:
    """Assemble the full (TP1) megatron tensor of ``pm`` from full HF tensors."""
    import torch

    rows = []
    for seg in pm.segments:
        for p in seg:
            if p.hf_name is None:
                like = next(t for t in hf.values())
                shape = (p.num_rows,) + ((pm.num_cols,) if pm.num_cols else ())
                rows.append(torch.zeros(shape, dtype=like.dtype))
            else:
                rows.append(hf[p.hf_name][p.start:p.stop])
    return torch.cat(rows, 0)


def split_full(pm: ParamMap, full: torch.Tensor) -> dict[str, torch.Tensor]:
    """Inverse of ``full_from_parts``: HF tensors from a full megatron tensor (padding dropped)."""
    import torch

    pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
    off = 0
    for seg in pm.segments:
        for p in seg:
            if p.hf_name is not None:
                pieces.setdefault(p.hf_name, []).append((p.start, full[off:off + p.num_rows]))
            off += p.num_rows
    out = {}
    for name, chunks in pieces.items():
        chunks.sort(key=lambda c: c[0])
        out[name] = torch.cat([c for _, c in chunks], 0) if len(chunks) > 1 else chunks[0][1]
    return out
