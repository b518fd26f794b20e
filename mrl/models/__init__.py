"""HF <-> Megatron bridges, one file per architecture, and the registry that picks one."""

from __future__ import annotations

from mrl.models.bridge import (ConfigNeedsTransformers, JsonConfig, ModelBridge, UnsupportedModelError,
                              read_config_json)
from mrl.models.deepseek_v3 import DeepseekV3Bridge
from mrl.models.glm4_moe import Glm4MoeBridge
from mrl.models.qwen3_moe import Qwen3MoeBridge

# A new family = one file with a ModelBridge subclass + one entry here (docs/models.md).
BRIDGES: dict[str, type[ModelBridge]] = {
    arch: cls for cls in (Qwen3MoeBridge, Glm4MoeBridge, DeepseekV3Bridge) for arch in cls.architectures}


def get_bridge(path: str, json_config: bool = False) -> ModelBridge:
    """Bridge for the HF checkpoint at ``path``; a clear error for architectures mrl does not map.

    ``json_config``: over config.json as written (``JsonConfig``), without importing transformers; the
    bridge then raises ConfigNeedsTransformers where transformers' defaults or type checks are needed."""
    raw = read_config_json(path)
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in BRIDGES), None)
    if arch is None:
        raise UnsupportedModelError(
            f"{path}/config.json: unsupported architecture {archs or raw.get('model_type')!r}; "
            f"mrl maps {sorted(BRIDGES)}"
        )
    if json_config:
        return BRIDGES[arch](JsonConfig(raw), path=path)
    from transformers import AutoConfig  # the config class normalises key names across versions

    return BRIDGES[arch](AutoConfig.from_pretrained(path), path=path)


__all__ = ["BRIDGES", "ConfigNeedsTransformers", "JsonConfig", "ModelBridge", "UnsupportedModelError",
           "get_bridge"]
