"""SGLang GPU mode: what an unmodified SGLang server needs to run on a node's GPUs.

- attention backend: triton unless ``engine.attention_backend`` names another. SGLang itself takes FA3 on
  Hopper, but SGLang 0.5.14's FA3 backend fails while the piecewise prefill CUDA graphs are captured
  (docs/gpu.md), so an FA3 engine starts without them (the launcher); triton has no JIT step at start-up,
  unlike flashinfer. ``fa3`` is refused where SGLang's kernel package lacks it (a network-less bundle may
  leave its 1.8 GB out).
- sampling backend: ``pytorch`` whenever Keep Sampling Mask rebuilds the engine's sampling support,
  since ``mrl.routing.sampling_mask`` reproduces that sampler (temperature, top-k, then top-p / min-p on
  the renormalised probabilities); flashinfer's fused sampler is kept otherwise.
- ``NCCL_CUMEM_ENABLE=0`` in the server's environment: the NCCL weight-update group fails with
  "Cuda failure 'invalid argument'" on cuMem-backed buffers on some hosts, leaving weights half updated.
- ``PYTHONPATH`` starts with ``mrl/engine/server/shim``: the patches every mrl engine gets
  (``mrl.engine.server.patches``), without CPU mode's.
- placement: ``--base-gpu-id``; several engines on a node take consecutive blocks of ``tp * dp`` GPUs,
  after the GPUs of the trainer ranks started on the same node.
- compile caches: SGLang compiles its piecewise prefill CUDA graphs with torch inductor and its MoE and
  attention kernels with triton at every start; ``compile_cache_dir`` puts both caches where the next job
  finds them (``mrl.compile_cache``).

``check_gpu_stack`` runs before an engine starts: a host with GPUs but without SGLang's GPU kernels
gets one error naming what is missing and how to install it, instead of a server dying in start-up.
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import os
import subprocess
import sys

from mrl.compile_cache import cache_env
from mrl.engine.server.patches import SHIM_DIR

INSTALL_HINT = ("pip install 'sglang==0.5.14' (brings sglang-kernel 0.4.4 for CUDA 13 and torch 2.11.0); "
                "on a host without network: scripts/gpu/fetch_parts.sh on a machine with the registry, then "
                "scripts/gpu/install_stack.sh on the host (scripts/gpu/README.md)")


class GPUStackError(RuntimeError):
    pass


def _package_dir(name: str) -> str | None:
    spec = importlib.util.find_spec(name)  # locates without importing (importing sgl_kernel loads CUDA)
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def has_fa3() -> bool:
    d = _package_dir("sgl_kernel")
    return bool(d and glob.glob(os.path.join(d, "flash_ops*.so")))


def attention_backend(asked: str | None = None) -> str:
    """The ``--attention-backend`` of a GPU engine: ``asked`` (``engine.attention_backend``) or triton."""
    if asked == "fa3" and not has_fa3():
        raise GPUStackError("engine.attention_backend=fa3, but SGLang's kernel package has no FA3 library "
                            "(sgl_kernel/flash_ops*.so): install the full sglang-kernel wheel, or add "
                            "scripts/gpu/fetch_fa3.sh's parts to the offline stack")
    return asked or "triton"


def check_gpu_packages() -> None:
    """The cheap part of ``check_gpu_stack`` (nothing imported, no GPU touched): SGLang and its GPU kernel
    package are installed."""
    if _package_dir("sglang") is None:
        raise GPUStackError(f"engine.cpu_mode=false: SGLang is not installed; {INSTALL_HINT}")
    if _package_dir("sgl_kernel") is None:
        raise GPUStackError(f"engine.cpu_mode=false: SGLang's GPU kernels (package sgl_kernel, from "
                            f"sglang-kernel) are not installed; {INSTALL_HINT}")


@functools.lru_cache(maxsize=1)
def check_gpu_stack() -> None:
    """Raise ``GPUStackError`` naming what is missing when SGLang cannot serve on this host's GPUs.

    Imports run in a child process: the caller (a trainer rank) must not initialise CUDA or load
    SGLang's kernels into its own address space."""
    check_gpu_packages()
    probe = ("import torch, sys\n"
             "if not torch.cuda.is_available(): sys.exit('torch sees no CUDA GPU (torch ' + torch.__version__ + ')')\n"
             "import sgl_kernel\n")
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or [res.stdout.strip()])[-1]
        raise GPUStackError(f"engine.cpu_mode=false: SGLang's GPU kernels do not load here ({last}); "
                            f"they need torch 2.11.0 with CUDA 13 and an NVIDIA driver; {INSTALL_HINT}")


def gpu_env(base: dict[str, str] | None = None, compile_cache_dir: str | None = None) -> dict[str, str]:
    env = dict(base if base is not None else os.environ)
    env.setdefault("NCCL_CUMEM_ENABLE", "0")
    for key, value in cache_env(compile_cache_dir).items():
        env.setdefault(key, value)
    env["PYTHONPATH"] = SHIM_DIR + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def trainer_gpus_on_this_node() -> int:
    """GPUs taken by the trainer ranks torchrun started on this node (0 outside a trainer rank)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
