"""Launcher command lines and CPU-mode environment (no server started here)."""

import os

import pytest

from mrl.engine import cpu_mode
from mrl.engine.launcher import Engine, server_args_to_cli


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


def test_load_format_dummy_reads_no_weights():
    cmd = Engine(model_path="/m", load_format="dummy", port=1).command()
    assert cmd[cmd.index("--load-format") + 1] == "dummy"
    assert "--load-format" not in Engine(model_path="/m", port=1).command()  # SGLang's own (auto)


def test_gpu_decode_graphs_sized_to_the_running_requests():
    cmd = Engine(model_path="/m", cpu_mode=False, max_running_requests=96, port=1).command()
    assert cmd[cmd.index("--cuda-graph-max-bs-decode") + 1] == "96"
    own = Engine(model_path="/m", cpu_mode=False, port=1, server_args={"cuda_graph_bs": [1, 8]}).command()
    assert "--cuda-graph-max-bs-decode" not in own and own[-3:] == ["--cuda-graph-bs", "1", "8"]
    assert "--cuda-graph-max-bs-decode" not in Engine(model_path="/m", port=1).command()  # CPU: no graphs


@pytest.mark.parametrize("kw,field", [(dict(ep=2), "engine.ep"),
                                      (dict(memory_saver=True), "engine.memory_saver"),
                                      (dict(dp=2, cpu_mode=False), "engine.dp")])
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
    # all cores by default; engine.cpu_threads sizes each rank's pool instead
    assert cpu_mode.cpu_env(1, base={}, cpus=[0, 1])["OMP_NUM_THREADS"] == "2"
    small = cpu_mode.cpu_env(1, base={}, cpus=[0, 1], threads=1)
    assert small["OMP_NUM_THREADS"] == "1" and small["SGLANG_CPU_OMP_THREADS_BIND"] == "0"


def test_cpu_engines_get_the_configured_thread_count(tmp_path, monkeypatch):
    from mrl.config.load import compose
    from mrl.engine.launcher import engines_from_config

    monkeypatch.setenv("MRL_CPU_STUB_DIR", str(tmp_path))
    cfg = compose([])  # the default run: conf/engine/cpu.yaml
    assert cfg.engine.cpu_threads == 1
    (eng,) = engines_from_config(cfg.engine, "/m", log_dir=str(tmp_path))
    assert eng.cpu_threads == 1
    assert cpu_mode.cpu_env(1, base={}, threads=eng.cpu_threads)["OMP_NUM_THREADS"] == "1"
    # no per-request access log: the engine's output is pumped through trainer rank 0's process
    cmd = eng.command()
    assert cmd[cmd.index("--log-level-http") + 1] == "warning"
    with pytest.raises(Exception, match="engine.cpu_threads"):
        compose(["engine.cpu_threads=0"])


def _gpu_engines(**kw):
    from mrl.config.load import compose

    overrides = ["engine=gpu", "model.dtype=bf16"] + [f"engine.{k}={v}" for k, v in kw.items()]
    return compose(overrides)


def test_gpu_engines_take_the_gpus_after_the_trainer_ranks(monkeypatch, tmp_path):
    from mrl.config.load import compose
    from mrl.engine import gpu_mode
    from mrl.engine.launcher import engines_from_config

    monkeypatch.setattr(gpu_mode, "has_fa3", lambda: False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two trainer ranks on this node: GPUs 0 and 1
    cfg = _gpu_engines(count=2, tp=2, mem_fraction_static=0.6)
    engines = engines_from_config(cfg.engine, "/m", log_dir=str(tmp_path))
    cmds = [e.command() for e in engines]
    assert [c[c.index("--base-gpu-id") + 1] for c in cmds] == ["2", "4"]
    for c in cmds:
        assert c[c.index("--attention-backend") + 1] == "triton" and "--device" not in c
        assert c[c.index("--mem-fraction-static") + 1] == "0.6" and "--max-total-tokens" not in c
        assert c[c.index("--dtype") + 1] == "bfloat16"  # the trainer's model.dtype
        assert "--sampling-backend" not in c
    monkeypatch.setattr(gpu_mode, "has_fa3", lambda: True)  # FA3 installed: still triton unless asked for
    fixed = engines_from_config(_gpu_engines(base_gpu_id=1).engine, "/m", log_dir=str(tmp_path))[0].command()
    assert fixed[fixed.index("--base-gpu-id") + 1] == "1" and fixed[fixed.index("--attention-backend") + 1] == "triton"
    asked = engines_from_config(_gpu_engines(attention_backend="fa3").engine, "/m", log_dir=str(tmp_path))[0]
    assert asked.command()[asked.command().index("--attention-backend") + 1] == "fa3"
    assert asked.command().count("--disable-prefill-cuda-graph") == 1  # FA3 faults capturing prefill graphs
    assert "--disable-prefill-cuda-graph" not in fixed
    own = compose(["engine=gpu", "model.dtype=bf16", "engine.attention_backend=fa3",
                   "+engine.server_args.cuda_graph_backend_prefill=tc_piecewise"])
    own_cmd = engines_from_config(own.engine, "/m", log_dir=str(tmp_path))[0].command()
    assert "--disable-prefill-cuda-graph" not in own_cmd  # the user's prefill graph choice stands
    assert own_cmd[own_cmd.index("--cuda-graph-backend-prefill") + 1] == "tc_piecewise"
    monkeypatch.setattr(gpu_mode, "has_fa3", lambda: False)
    with pytest.raises(gpu_mode.GPUStackError, match="attention_backend=fa3.*flash_ops"):
        asked.command()


def test_gpu_engines_sample_with_the_backend_the_mask_rebuilds():
    from mrl.config.load import compose

    gpu = ["engine=gpu", "model.dtype=bf16"]
    assert compose(gpu + ["train.sampling_mask=true"]).engine.sampling_backend == "pytorch"
    assert compose(gpu).engine.sampling_backend is None
    with pytest.raises(ValueError, match="engine.sampling_backend"):
        compose(gpu + ["train.sampling_mask=true", "engine.sampling_backend=flashinfer"])
    with pytest.raises(ValueError, match="engine.dtype"):
        compose(["engine.dtype=bfloat16"])  # CPU mode: float32 only
    assert compose([]).engine.dtype == "float32"


def test_gpu_engine_without_sglang_kernels_names_what_is_missing(monkeypatch, tmp_path):
    from mrl.engine import gpu_mode

    real = gpu_mode._package_dir
    monkeypatch.setattr(gpu_mode, "_package_dir", lambda name: None if name == "sgl_kernel" else real(name))
    gpu_mode.check_gpu_stack.cache_clear()
    try:
        with pytest.raises(gpu_mode.GPUStackError, match="sgl_kernel.*scripts/gpu/install_stack.sh"):
            Engine(model_path="/m", cpu_mode=False, log_dir=str(tmp_path), port=1).start()
    finally:
        gpu_mode.check_gpu_stack.cache_clear()


def test_gpu_stack_check_on_this_cpu_host_says_there_is_no_gpu():
    """On this CPU-only host the kernels are installed (CPU mode needs them) but torch sees no GPU."""
    from mrl.engine import gpu_mode

    gpu_mode.check_gpu_stack.cache_clear()
    try:
        with pytest.raises(gpu_mode.GPUStackError, match="no CUDA GPU"):
            gpu_mode.check_gpu_stack()
    finally:
        gpu_mode.check_gpu_stack.cache_clear()


def test_gpu_engines_refuse_float32():
    from mrl.config.load import compose

    with pytest.raises(ValueError, match="engine.dtype.*bfloat16 or float16"):
        compose(["engine=gpu"])  # model.dtype fp32 (the tiny preset's) would make a float32 GPU engine
    mixed = compose(["engine=gpu", "model.dtype=fp32", "engine.dtype=bfloat16"])
    assert mixed.engine.dtype == "bfloat16"


def test_gpu_engine_on_a_trainer_gpu_needs_a_transport_that_can_share_it():
    from mrl.config.load import compose

    gpu = ["engine=gpu", "model.dtype=bf16", "parallel.world_size=2"]
    with pytest.raises(ValueError, match=r"engine.base_gpu_id.*NCCL cannot join two ranks of one GPU"):
        compose(gpu + ["engine.base_gpu_id=1"])
    assert compose(gpu + ["engine.base_gpu_id=2"]).engine.base_gpu_id == 2  # GPUs of its own
    assert compose(gpu + ["engine.base_gpu_id=0", "weight_sync.transport=disk"]).engine.base_gpu_id == 0
    assert compose(gpu).engine.base_gpu_id is None  # null: the GPUs after the trainer's


_GC_PROBE = """
import gc
runs = []
gc.callbacks.append(lambda phase, info: runs.append(info["generation"]) if phase == "start" else None)
from sglang.srt.platforms.cpu import CpuDeviceMixin
del runs[:]
CpuDeviceMixin.empty_cache(None)
print("full collections:", sum(g == 2 for g in runs))
"""


@pytest.mark.parametrize("shim", [True, False])
def test_cpu_engines_skip_sglangs_full_gc_on_every_cache_flush(shim):
    """SGLang's CPU platform answers empty_cache (every /flush_cache, so every weight sync) with a full
    gc.collect(); inside a CPU-mode engine (the pyshim on its path) it is a no-op."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if shim:
        env["PYTHONPATH"] = cpu_mode.PYSHIM_DIR
    out = subprocess.run([sys.executable, "-c", _GC_PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"full collections: {0 if shim else 1}" in out.stdout


def test_gpu_engines_keep_their_compile_caches_where_the_next_run_finds_them(tmp_path):
    from mrl.engine import gpu_mode
    from mrl.engine.launcher import engines_from_config

    engine = engines_from_config(_gpu_engines(compile_cache_dir=str(tmp_path / "cc")).engine, "/m",
                                 log_dir=str(tmp_path))[0]
    env = gpu_mode.gpu_env(base={}, compile_cache_dir=engine.compile_cache_dir)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cc" / "inductor")
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / "cc" / "triton")
    home = gpu_mode.gpu_env(base={"HOME": str(tmp_path)}, compile_cache_dir="~/c")["TRITON_CACHE_DIR"]
    assert home == os.path.join(os.path.expanduser("~"), "c", "triton")
    mine = gpu_mode.gpu_env(base={"TORCHINDUCTOR_CACHE_DIR": "/mine"}, compile_cache_dir="/shared")
    assert mine["TORCHINDUCTOR_CACHE_DIR"] == "/mine" and mine["TRITON_CACHE_DIR"] == "/shared/triton"
    assert not {"TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"} & set(gpu_mode.gpu_env(base={}))
    assert _gpu_engines().engine.compile_cache_dir == "~/.cache/mrl/compile"  # on by default
