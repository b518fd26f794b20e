"""SGLang CPU mode: what an unmodified sglang 0.5.14 server needs to run on a GPU-less x86 host.

fp32 only (bf16 gives NaN logits on CPU), torch_native attention, no CUDA graphs or overlap
scheduling, a compiled stub of the CUDA driver library on LD_LIBRARY_PATH, and a pin_memory shim.
EP>1 and update_weights_from_tensor do not work on CPU; TP=2 does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "server", "cpu")
STUB_SRC = os.path.join(HERE, "cudastub.c")
PYSHIM_DIR = os.path.join(HERE, "pyshim")

CPU_SERVER_ARGS = [
    "--device", "cpu", "--attention-backend", "torch_native", "--disable-overlap-schedule",
    "--disable-cuda-graph", "--dtype", "float32",
    # an idle scheduler otherwise busy-polls a whole core: on a 2-core box that starves the trainer
    "--sleep-on-idle",
]


def default_stub_dir() -> str:
    return os.environ.get("MRL_CPU_STUB_DIR") or os.path.join(sys.prefix, "mrl-cpu")


def ensure_cuda_stub(build_dir: str | None = None) -> str:
    """Compile the driver stub (once) and return the directory holding ``libcuda.so.1``."""
    build_dir = build_dir or default_stub_dir()
    lib = os.path.join(build_dir, "libcuda.so.1")
    if os.path.isfile(lib) and os.path.getmtime(lib) >= os.path.getmtime(STUB_SRC):
        return build_dir
    cc = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if cc is None:
        raise RuntimeError("SGLang CPU mode needs a C compiler (gcc or cc) to build the CUDA driver stub")
    os.makedirs(build_dir, exist_ok=True)
    tmp = lib + f".tmp{os.getpid()}"
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", tmp, STUB_SRC], check=True)
    os.replace(tmp, lib)  # atomic: concurrent launchers never see a half-written library
    return build_dir


def cpu_env(tp: int, base: dict[str, str] | None = None, cpus: list[int] | None = None,
            batched_attention: bool = True, threads: int | None = None) -> dict[str, str]:
    """Environment of an SGLang server process in CPU mode, its ranks sharing ``cpus`` (default: all).

    With CUDA-only sgl_kernel builds SGLang cannot bind OpenMP threads itself (it needs the AMX
    kernels), so the launcher pins the process group to ``cpus`` and sizes each rank's thread pool:
    two engines on one box must not both spin threads on every core. ``threads``: each rank's pool
    (default: its share of ``cpus``); a small model's operators are too small to split, and an OpenMP
    worker waiting for its share spins on a core the trainer needs. ``batched_attention`` switches
    SGLang's torch_native backend to ``mrl.engine.server.cpu_attention`` (through the pyshim).
    """
    env = dict(base if base is not None else os.environ)
    stub = ensure_cuda_stub()
    cpus = cpus or sorted(os.sched_getaffinity(0))
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env["LD_LIBRARY_PATH"] = stub + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    env["PYTHONPATH"] = PYSHIM_DIR + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("TORCHDYNAMO_DISABLE", "1")
    env["MRL_CPU_BATCHED_ATTENTION"] = "1" if batched_attention else "0"
    per = threads or max(1, len(cpus) // tp)
    env["OMP_NUM_THREADS"] = str(per)
    # one block of cores per TP rank ("0|1" for TP2 on 2 cores); ranks share cores when there are fewer
    blocks = [cpus[(r * per) % len(cpus):(r * per) % len(cpus) + per] for r in range(tp)]
    env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, b)) for b in blocks)
    if tp > 1:
        env["SGLANG_NCCL_SO_PATH"] = "/nonexistent"  # keeps pynccl from probing a CUDA device
    return env


if __name__ == "__main__":  # python -m mrl.engine.cpu_mode  (setup builds the stub ahead of time)
    print(ensure_cuda_stub())
