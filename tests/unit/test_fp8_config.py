"""``rollout.quantization`` and ``rollout.kv_cache_dtype``: accepted values, refusals naming the field."""

from __future__ import annotations

import pytest

from mrl.config.load import compose


def test_defaults_are_off():
    cfg = compose()
    assert cfg.rollout.quantization is None and cfg.rollout.kv_cache_dtype is None


def test_fp8_on_gpu_engines():
    cfg = compose(["rollout=gpu", "model.dtype=bf16", "rollout.quantization=fp8", "rollout.kv_cache_dtype=fp8_e4m3"])
    assert cfg.rollout.quantization == "fp8" and cfg.rollout.kv_cache_dtype == "fp8_e4m3"


def test_fp8_kv_cache_on_cpu_engines():
    assert compose(["rollout.kv_cache_dtype=fp8_e4m3"]).rollout.kv_cache_dtype == "fp8_e4m3"


@pytest.mark.parametrize("overrides, message", [
    (["rollout.quantization=fp8"], r"rollout.quantization: =fp8: CPU engines cannot serve block-FP8 weights"),
    (["rollout=gpu", "model.dtype=bf16", "rollout.quantization=int4"],
     r"rollout.quantization: must be one of \[None, 'fp8'\], got 'int4'"),
    (["rollout=gpu", "model.dtype=bf16", "rollout.kv_cache_dtype=fp4_e2m1"],
     r"rollout.kv_cache_dtype: must be one of .*'fp8_e4m3'.*got 'fp4_e2m1'"),
])
def test_refusals_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        compose(overrides)
