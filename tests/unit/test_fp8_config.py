"""``engine.quantization`` and ``engine.kv_cache_dtype``: accepted values, refusals naming the field, what
reaches the engines' command, and the preflight's block-shape check of FP8 engines."""

from __future__ import annotations

import re

import pytest

from mrl.config.load import compose
from mrl.engine.launcher import engines_from_config


def test_defaults_are_off():
    cfg = compose()
    assert cfg.engine.quantization is None and cfg.engine.kv_cache_dtype is None


def test_fp8_kv_cache_reaches_the_engines_command():
    for overrides in (["engine.kv_cache_dtype=fp8_e4m3"], ["engine=gpu", "model.dtype=bf16",
                                                            "engine.kv_cache_dtype=fp8_e4m3"]):
        cfg = compose(overrides)
        (engine,) = engines_from_config(cfg.engine, "/m", log_dir="/tmp", names=["e0"])
        cmd = engine.command() if cfg.engine.cpu_mode else None
        assert cfg.engine.kv_cache_dtype == "fp8_e4m3" and engine.kv_cache_dtype == "fp8_e4m3"
        if cmd is not None:
            assert cmd[cmd.index("--kv-cache-dtype") + 1] == "fp8_e4m3"
    (plain,) = engines_from_config(compose().engine, "/m", log_dir="/tmp", names=["e0"])
    assert "--kv-cache-dtype" not in plain.command()


@pytest.mark.parametrize("overrides, message", [
    (["engine.quantization=fp8"], r"engine.quantization: =fp8: CPU engines cannot serve block-FP8 weights"),
    (["engine=gpu", "model.dtype=bf16", "engine.quantization=fp8", "model.lora.rank=8"],
     r"engine.quantization: =fp8 with model.lora"),
    (["engine=gpu", "model.dtype=bf16", "+engine.server_args.quantization=fp8"],
     r"engine.server_args.quantization: set engine.quantization instead"),
    (["+engine.server_args.kv_cache_dtype=fp8_e4m3"],
     r"engine.server_args.kv_cache_dtype: set engine.kv_cache_dtype instead"),
    (["engine=gpu", "model.dtype=bf16", "engine.quantization=int4"],
     r"engine.quantization: must be one of \[None, 'fp8'\], got 'int4'"),
    (["engine=gpu", "model.dtype=bf16", "engine.kv_cache_dtype=fp4_e2m1"],
     r"engine.kv_cache_dtype: must be one of .*'fp8_e4m3'.*got 'fp4_e2m1'"),
])
def test_refusals_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        compose(overrides)


def test_fp8_gpu_engines_are_accepted_and_get_the_flags():
    cfg = compose(["engine=gpu", "model.dtype=bf16", "engine.quantization=fp8"])
    (engine,) = engines_from_config(cfg.engine, "/run/fp8_model", log_dir="/tmp", names=["e0"])
    cmd = engine.command()
    assert cmd[cmd.index("--quantization") + 1] == "fp8" and cmd[cmd.index("--dtype") + 1] == "bfloat16"
    assert cmd[cmd.index("--model-path") + 1] == "/run/fp8_model"
    assert "--kv-cache-dtype" not in cmd  # independent of the weights' format
    colocated = compose(["engine=gpu", "model.dtype=bf16", "engine.quantization=fp8", "weight_sync.transport=tensor",
                         "engine.base_gpu_id=0"])  # one GPU: CUDA IPC sends the quantized tensors
    assert colocated.weight_sync.transport.value == "tensor" and colocated.engine.quantization == "fp8"


@pytest.mark.parametrize("overrides, problem", [
    (["model=tiny_gpu"], None),
    (["model=tiny_gpu", "engine.tp=2"], r"k_proj = 64 rows per engine rank"),
    ([], r"q_proj = 64 rows per engine rank"),  # the default tiny (hidden 64): no block FP8 at all
])
def test_preflight_checks_the_fp8_block_shapes(tmp_path, overrides, problem):
    from mrl.preflight import check_fp8_shapes

    cfg = compose(["engine=gpu", "model.dtype=bf16", "engine.quantization=fp8",
                   f"model.hf_path={tmp_path / 'missing'}", *overrides])  # made on first use: the preset's config
    msg = check_fp8_shapes(cfg, "local")
    if problem is None:
        assert msg is None
    else:
        assert msg.startswith("engine.quantization=fp8: SGLang's block-FP8 layers cannot load") and "\n" not in msg
        assert f"engine.tp={cfg.engine.tp}" in msg
        assert re.search(problem, msg), msg
    assert check_fp8_shapes(compose(["model=tiny_gpu"]), "local") is None  # bf16 engines: nothing to check


def test_preflight_reads_the_models_config(ckpt_dir):
    from mrl.preflight import check_fp8_shapes

    base = ["engine=gpu", "model.dtype=bf16", "engine.quantization=fp8", "model.make_tiny_if_missing=false"]
    assert check_fp8_shapes(compose([*base, f"model.hf_path={ckpt_dir['tiny_gpu']}"]), "local") is None
    assert "cannot load" in check_fp8_shapes(compose([*base, f"model.hf_path={ckpt_dir['stress_b']}"]), "local")
