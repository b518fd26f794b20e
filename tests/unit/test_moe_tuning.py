"""mrl.engine.moe_tuning on CPU: the search space, the choice per token count, SGLang's table names, and
the merged folder that SGLang's own table lookup (real SGLang 0.5.14 code) reads the tuned tables from."""

import json
import os

import pytest

from mrl.engine import moe_tuning as mt

SHAPE = mt.MoeShape(experts=128, intermediate=768, hidden=2048, top_k=8)


def test_search_space_respects_the_fp8_scale_block():
    full = mt.search_space("full")
    fp8 = mt.search_space("full", mt.FP8_BLOCK)
    assert len(full) == 4 * 4 * 3 * 4 * 2 * 4
    assert 0 < len(fp8) < len(full)
    assert all(128 % c["BLOCK_SIZE_N"] == 0 and 128 % c["BLOCK_SIZE_K"] == 0 for c in fp8)
    assert {c["BLOCK_SIZE_K"] for c in fp8} == {64, 128}  # 256 spans two scale blocks
    assert len({json.dumps(c, sort_keys=True) for c in full}) == len(full)
    with pytest.raises(ValueError, match="search space 'huge'"):
        mt.search_space("huge")
    narrow = mt.search_space("quick", mt.FP8_BLOCK, {"BLOCK_SIZE_M": (16, 32), "num_stages": (3,)})
    assert {c["BLOCK_SIZE_M"] for c in narrow} == {16, 32} and {c["num_stages"] for c in narrow} == {3}
    with pytest.raises(ValueError, match="BLOCK_M"):
        mt.search_space("quick", None, {"BLOCK_M": (16,)})


def test_tune_takes_the_fastest_configuration_per_token_count_and_skips_failures():
    configs = [{"BLOCK_SIZE_M": m} for m in (16, 32, 64)]

    def time_fn(tokens, c):
        if c["BLOCK_SIZE_M"] == 64 and tokens < 100:
            raise RuntimeError("out of resources: shared memory")
        # small tiles win for few tokens per expert, large ones for many
        return abs(c["BLOCK_SIZE_M"] - tokens / 4) + 1.0

    table, timings = mt.tune([8, 128, 1024], configs, time_fn)
    assert table == {8: {"BLOCK_SIZE_M": 16}, 128: {"BLOCK_SIZE_M": 32}, 1024: {"BLOCK_SIZE_M": 64}}
    assert "out of resources" in timings[8]["tried"][json.dumps({"BLOCK_SIZE_M": 64})]
    assert timings[1024]["best_s"] == abs(64 - 256) + 1.0
    with pytest.raises(RuntimeError, match="no configuration ran at 8 tokens"):
        mt.tune([8], configs[2:], time_fn)


def test_sglangs_own_choice_is_timed_and_kept_where_it_wins():
    configs = [{"BLOCK_SIZE_M": 16}, {"BLOCK_SIZE_M": 32}]
    speed = {16: 3.0, 32: 2.0, 64: 1.0}  # seconds per call by tile height, whatever the token count
    table, timings = mt.tune([8, 256], configs, lambda m, c: speed[c["BLOCK_SIZE_M"]])
    sglang = {8: {"BLOCK_SIZE_M": 16}, 256: {"BLOCK_SIZE_M": 64}}  # slower at 8, faster at 256 (not searched)
    mt.against_sglang(table, timings, lambda m, c: speed[c["BLOCK_SIZE_M"]], sglang.__getitem__)
    assert table == {8: {"BLOCK_SIZE_M": 32}, 256: {"BLOCK_SIZE_M": 64}}
    assert timings[8]["sglang_over_tuned"] == 1.5 and timings[256]["sglang_over_tuned"] == 1.0
    assert timings[256]["best_s"] == 1.0 and timings[8]["sglang_config"] == {"BLOCK_SIZE_M": 16}


def test_sglang_reads_the_tuned_table_from_the_merged_folder(tmp_path, monkeypatch):
    """The tuned table is found under the running triton's version; SGLang's own tables for every other
    shape and version stay where its lookup expects them."""
    import triton
    from sglang.srt.layers.moe.moe_runner.triton_utils import fused_moe_triton_config as cfgmod

    mt._server_args_defaults()
    monkeypatch.setattr(cfgmod, "get_device_name", lambda: "NVIDIA H200")
    table = {1: {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1, "num_warps": 4,
                 "num_stages": 3},
             256: {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1, "num_warps": 4,
                   "num_stages": 4}}
    tuned = tmp_path / "tuned"
    path = mt.write_table(str(tuned), triton.__version__, mt.table_name(SHAPE, fp8=True), table)
    assert os.path.basename(path) == "E=128,N=768,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128, 128].json"
    assert os.path.basename(os.path.dirname(path)) == "triton_" + triton.__version__.replace(".", "_")
    merged = mt.merged_config_dir(str(tuned), str(tmp_path / "merged"))

    own = mt.sglang_config_root()
    shipped = sorted(os.listdir(os.path.join(own, "configs", "triton_3_2_0")))
    assert shipped and sorted(os.listdir(os.path.join(merged, "configs", "triton_3_2_0"))) == shipped

    monkeypatch.setenv("SGLANG_MOE_CONFIG_DIR", merged)
    cfgmod.get_moe_configs.cache_clear()
    try:
        got = cfgmod.get_moe_configs(128, 768, "fp8_w8a8", 128, 128)
        assert got == table
        # a shape mrl did not tune: SGLang's own table, through the merged folder
        bf16 = cfgmod.get_moe_configs(128, 768, None, 0, 0)
        with open(os.path.join(own, "configs", "triton_3_2_0", "E=128,N=768,device_name=NVIDIA_H200.json")) as f:
            assert bf16 == {int(k): v for k, v in json.load(f).items()}
    finally:
        cfgmod.get_moe_configs.cache_clear()

    # re-merging (a restarted engine) replaces the links instead of failing on them
    assert mt.merged_config_dir(str(tuned), merged) == merged


def test_merged_folder_refuses_a_folder_without_tables(tmp_path):
    with pytest.raises(ValueError, match="no configs/ folder"):
        mt.merged_config_dir(str(tmp_path), str(tmp_path / "m"))


def test_shape_from_the_checkpoint(tmp_path):
    from mrl.models.tiny import make_tiny_model

    hf = make_tiny_model(str(tmp_path / "tiny"))
    with open(os.path.join(hf, "config.json")) as f:
        c = json.load(f)
    s = mt.MoeShape.from_hf(hf)
    assert (s.experts, s.intermediate, s.hidden, s.top_k) == (
        c.get("num_experts", c.get("num_local_experts")), c["moe_intermediate_size"], c["hidden_size"],
        c["num_experts_per_tok"])
    with pytest.raises(ValueError, match="not divisible by tp 7"):
        mt.MoeShape.from_hf(hf, tp=7)


def test_config_and_preflight_name_a_bad_tuned_folder(tmp_path, monkeypatch):
    import mrl.engine.gpu_mode as gpu_mode
    import mrl.preflight as preflight
    from mrl.config.load import compose

    with pytest.raises(ValueError, match="engine.moe_kernel_configs"):
        compose([f"engine.moe_kernel_configs={tmp_path}"])  # the default engines run on CPU
    cfg = compose(["engine=gpu", "model.dtype=bf16", f"engine.moe_kernel_configs={tmp_path}"])
    # this host as a GPU host with SGLang's kernels: only the tuned folder is left to check
    monkeypatch.setattr(gpu_mode, "check_gpu_packages", lambda: None)
    monkeypatch.setattr(preflight.glob, "glob", lambda pattern: ["/dev/nvidia0"])
    msg = preflight.check_gpu_stack(cfg, preflight.LOCAL)
    assert msg == f"engine.moe_kernel_configs={tmp_path}: no configs/ folder there (`mrl tune-moe HF_DIR OUT`)"
    os.makedirs(tmp_path / "configs")
    assert preflight.check_gpu_stack(cfg, preflight.LOCAL) is None


def test_gpu_engines_of_the_config_get_the_merged_tables(tmp_path, monkeypatch):
    """engine.moe_kernel_configs reaches each GPU engine's environment as a merged folder beside its log,
    which holds the tuned table and SGLang's own; without the field the variable is not set."""
    import triton

    from mrl.config.load import compose
    from mrl.engine.launcher import engines_from_config

    monkeypatch.delenv("SGLANG_MOE_CONFIG_DIR", raising=False)
    tuned = tmp_path / "tuned"
    mt.write_table(str(tuned), triton.__version__, "E=128,N=768,device_name=NVIDIA_H200.json",
                   {1: {"BLOCK_SIZE_M": 16}})
    cfg = compose(["engine=gpu", "model.dtype=bf16", f"engine.moe_kernel_configs={tuned}"])
    (engine,) = engines_from_config(cfg.engine, "/m", log_dir=str(tmp_path / "logs"), names=["e0"])
    merged = engine.environment()["SGLANG_MOE_CONFIG_DIR"]
    assert merged == str(tmp_path / "logs" / "e0_moe_configs")
    version = "triton_" + triton.__version__.replace(".", "_")
    link = os.path.join(merged, "configs", version, "E=128,N=768,device_name=NVIDIA_H200.json")
    assert os.path.realpath(link) == str(tuned / "configs" / version / "E=128,N=768,device_name=NVIDIA_H200.json")
    assert os.listdir(os.path.join(merged, "configs", "triton_3_2_0"))  # SGLang's own tables, linked
    plain = compose(["engine=gpu", "model.dtype=bf16"])
    (engine,) = engines_from_config(plain.engine, "/m", log_dir=str(tmp_path / "logs2"), names=["e0"])
    assert "SGLANG_MOE_CONFIG_DIR" not in engine.environment()
