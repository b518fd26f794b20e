"""Compose and load configs outside Hydra apps (tests, per-rank workers reading RUN_DIR/config.yaml)."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from mrl.config.schema import Config
from mrl.config.store import CONF_DIR, register


def to_config(cfg: DictConfig) -> Config:
    """Typed Config from a composed DictConfig; runs every ``__post_init__`` check."""
    return OmegaConf.to_object(cfg)


def compose(overrides: list[str] | None = None) -> Config:
    """What ``mrl <cmd> overrides...`` would see, without running an app."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=overrides or [], return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)  # for ${hydra:...} interpolations such as run_dir
    with open_dict(cfg):
        del cfg["hydra"]
    OmegaConf.resolve(cfg)
    return to_config(cfg)


def load_resolved(path: str) -> Config:
    """Load a resolved ``config.yaml`` written by the launcher, validated against the schema."""
    return to_config(OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(path)))
