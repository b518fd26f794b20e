"""``rollout.quantization`` and ``rollout.kv_cache_dtype``: accepted values, refusals naming the field."""

from __future__ import annotations

import pytest

from mrl.config.load import compose
from mrl.engine.launcher import engines_from_config


def test_defaults_are_off():
    cfg = compose()
    assert cfg.rollout.quantization is None and cfg.rollout.kv_cache_dtype is None


def test_fp8_kv_cache_reaches_the_engines_command():
    for overrides in (["rollout.kv_cache_dtype=fp8_e4m3"], ["rollout=gpu", "model.dtype=bf16",
                                                            "rollout.kv_cache_dtype=fp8_e4m3"]):
        cfg = compose(overrides)
        (engine,) = engines_from_config(cfg.rollout, "/m", log_dir="/tmp", names=["e0"])
        cmd = engine.command() if cfg.rollout.cpu_mode else None
        assert cfg.rollout.kv_cache_dtype == "fp8_e4m3" and engine.kv_cache_dtype == "fp8_e4m3"
        if cmd is not None:
            assert cmd[cmd.index("--kv-cache-dtype") + 1] == "fp8_e4m3"
    (plain,) = engines_from_config(compose().rollout, "/m", log_dir="/tmp", names=["e0"])
    assert "--kv-cache-dtype" not in plain.command()


@pytest.mark.parametrize("overrides, message", [
    (["rollout.quantization=fp8"], r"rollout.quantization: =fp8: CPU engines cannot serve block-FP8 weights"),
    (["rollout=gpu", "model.dtype=bf16", "rollout.quantization=fp8"],
     r"rollout.quantization: =fp8: the trainer's weight sync does not quantize yet"),
    (["rollout=gpu", "model.dtype=bf16", "rollout.quantization=int4"],
     r"rollout.quantization: must be one of \[None, 'fp8'\], got 'int4'"),
    (["rollout=gpu", "model.dtype=bf16", "rollout.kv_cache_dtype=fp4_e2m1"],
     r"rollout.kv_cache_dtype: must be one of .*'fp8_e4m3'.*got 'fp4_e2m1'"),
])
def test_refusals_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        compose(overrides)
