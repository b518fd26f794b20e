"""Compose and load configs outside Hydra apps (tests, per-rank workers reading RUN_DIR/config.yaml)."""

from __future__ import annotations

import dataclasses
import difflib

from omegaconf import DictConfig, OmegaConf

from mrl.config.moved import MovedKeyError, check_overrides, explain, moved_key_message
from mrl.config.schema import Config
from mrl.config.store import CONF_DIR, register


def to_config(cfg: DictConfig) -> Config:
    """Typed Config from a composed DictConfig; runs every ``__post_init__`` check."""
    _check_no_unknown_keys(cfg)
    return OmegaConf.to_object(cfg)


def _check_no_unknown_keys(node: DictConfig, path: str = "") -> None:
    """Hydra's ``+key=value`` adds keys even to a structured config, and ``to_object`` then sets them as
    stray attributes that nothing reads: ``+train.sft_warmup_step=0`` (a typo) would be silently ignored.
    Only dict-typed fields (``engine.server_args``, ``data.task_args``, ...) take new keys."""
    cls = OmegaConf.get_type(node)
    if dataclasses.is_dataclass(cls):
        names = [f.name for f in dataclasses.fields(cls)]
        for key in node.keys():
            if key not in names:
                if moved := moved_key_message(f"{path}{key}"):
                    raise MovedKeyError(moved)
                near = difflib.get_close_matches(str(key), names, n=1)
                raise ValueError(f"{path}{key}: not a field of {cls.__name__}"
                                 + (f" (did you mean {path}{near[0]}?)" if near else f"; fields: {names}"))
    for key in node.keys():
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            _check_no_unknown_keys(child, f"{path}{key}.")


def compose(overrides: list[str] | None = None) -> Config:
    """What ``mrl <cmd> overrides...`` would see, without running an app."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    check_overrides(overrides or [])
    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        try:
            cfg = hydra_compose(config_name="config", overrides=overrides or [], return_hydra_config=True)
        except Exception as e:  # a preset or experiment that sets a moved key: name its new one
            if moved := explain(e):
                raise moved from None
            raise
    HydraConfig.instance().set_config(cfg)  # for ${hydra:...} interpolations such as run_dir
    with open_dict(cfg):
        del cfg["hydra"]
    OmegaConf.resolve(cfg)
    return to_config(cfg)


def load_resolved(path: str) -> Config:
    """Load a resolved ``config.yaml`` written by the launcher, validated against the schema."""
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(path))
    except Exception as e:  # a run directory written before a key moved
        if moved := explain(e):
            raise moved from None
        raise
    return to_config(cfg)
