"""Launcher command lines and CPU-mode environment (no server started here)."""

import os

import pytest

from mrl.rollout import cpu_mode
from mrl.rollout.engine import Engine, server_args_to_cli


def test_server_args_passthrough():
    assert server_args_to_cli({"enable_dp_attention": True, "mem_fraction_static": 0.8, "off": False,
                               "cuda_graph_bs": [1, 2]}) == [
        "--enable-dp-attention", "--mem-fraction-static", "0.8", "--cuda-graph-bs", "1", "2"]


def test_cpu_command_has_the_rl_flags():
    e = Engine(model_path="/m", tp=2, port=31000, server_args={"chunked_prefill_size": 512})
    cmd = e.command()
    for flag in ("--skip-tokenizer-init", "--enable-return-routed-experts", "--sleep-on-idle", "--disable-cuda-graph"):
        assert flag in cmd
    assert cmd[cmd.index("--tp-size") + 1] == "2" and cmd[cmd.index("--dtype") + 1] == "float32"
    assert cmd[cmd.index("--device") + 1] == "cpu" and cmd[-2:] == ["--chunked-prefill-size", "512"]
    assert e.url == "http://127.0.0.1:31000"


def test_gpu_command():
    cmd = Engine(model_path="/m", tp=8, ep=8, cpu_mode=False, memory_saver=True, port=1).command()
    assert "--device" not in cmd and "--enable-memory-saver" in cmd and cmd[cmd.index("--ep-size") + 1] == "8"


@pytest.mark.parametrize("kw,field", [(dict(ep=2), "rollout.engine_ep"), (dict(memory_saver=True), "rollout.memory_saver"),
                                      (dict(dp=2, cpu_mode=False), "rollout.engine_dp")])
def test_invalid_engine_layouts_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        Engine(model_path="/m", **kw)


def test_cpu_env_builds_the_stub_and_splits_cores(tmp_path, monkeypatch):
    monkeypatch.setenv("MRL_CPU_STUB_DIR", str(tmp_path))
    env = cpu_mode.cpu_env(2, base={"PATH": os.environ["PATH"]}, cpus=[0, 1])
    assert os.path.isfile(tmp_path / "libcuda.so.1")
    assert env["LD_LIBRARY_PATH"].split(":")[0] == str(tmp_path)
    assert env["PYTHONPATH"].split(":")[0] == cpu_mode.PYSHIM_DIR
    assert env["SGLANG_CPU_OMP_THREADS_BIND"] == "0|1" and env["OMP_NUM_THREADS"] == "1"
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["MRL_CPU_BATCHED_ATTENTION"] == "1"
    assert cpu_mode.cpu_env(1, base={}, batched_attention=False)["MRL_CPU_BATCHED_ATTENTION"] == "0"
    one = cpu_mode.cpu_env(1, base={}, cpus=[1])
    assert one["SGLANG_CPU_OMP_THREADS_BIND"] == "1" and "SGLANG_NCCL_SO_PATH" not in one
