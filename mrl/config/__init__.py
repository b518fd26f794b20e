"""Typed configuration schema of every mrl component. Imports no torch, megatron or sglang."""

from mrl.config.schema import (
    AlgoConfig,
    ClusterConfig,
    Config,
    DataConfig,
    Dispatcher,
    EngineConfig,
    DType,
    ModelConfig,
    ParallelConfig,
    RewardConfig,
    RolloutConfig,
    TinyPreset,
    WeightSyncConfig,
)

__all__ = [
    "AlgoConfig",
    "ClusterConfig",
    "Config",
    "DataConfig",
    "Dispatcher",
    "EngineConfig",
    "DType",
    "ModelConfig",
    "ParallelConfig",
    "RewardConfig",
    "RolloutConfig",
    "TinyPreset",
    "WeightSyncConfig",
]
