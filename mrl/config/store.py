"""Register the schema with Hydra's ConfigStore; YAML presets in conf/ extend these nodes."""

from __future__ import annotations

import os

from hydra.core.config_store import ConfigStore

from mrl.config import schema

GROUPS = {
    "model": schema.ModelConfig,
    "parallel": schema.ParallelConfig,
    "engine": schema.EngineConfig,
    "rollout": schema.RolloutConfig,
    "algo": schema.AlgoConfig,
    "data": schema.DataConfig,
    "reward": schema.RewardConfig,
    "scoring": schema.ScoringConfig,
    "weight_sync": schema.WeightSyncConfig,
    "cluster": schema.ClusterConfig,
    "train": schema.TrainConfig,
}

CONF_DIR = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "conf"))


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=schema.Config)
    for group, node in GROUPS.items():
        cs.store(group=group, name=f"{group}_schema", node=node)
