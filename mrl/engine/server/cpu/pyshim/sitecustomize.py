"""Loaded only by SGLang server processes in mrl's CPU mode (PYTHONPATH set by the launcher).

SGLang's routed-experts host buffer asks for pinned memory unconditionally
(srt/layers/moe/routed_experts_capturer.py); without a driver, pinning fails with "Found no NVIDIA
driver". On a host without CUDA, tensor factories ignore ``pin_memory``. Never imported by the trainer.

With ``MRL_CPU_BATCHED_ATTENTION=1`` SGLang's ``torch_native`` attention backend is switched to
``mrl.engine.server.cpu_attention`` (one SDPA call per batch instead of one per sequence) as soon as SGLang
imports it: a hook on the import, so processes that never load SGLang's model code (the resource
tracker) do not pay for importing it.

SGLang's CPU platform answers ``empty_cache`` (called by every ``/flush_cache``, so by every weight
sync) with a full ``gc.collect()`` of the scheduler's heap: half a second per sync on a 2-core box,
for reference cycles that Python's own generational collector frees anyway. Here it does nothing, as
on SGLang versions whose CPU platform had no ``empty_cache``.

SGLang starts its scheduler and detokenizer processes with ``spawn`` (CUDA cannot be forked): each
imports torch and SGLang again, the larger part of an engine's start on a small CPU box. Without CUDA
nothing forbids ``fork``, and the children start from the server's imported modules; the server has not
started a thread or a torch thread pool when it forks them.

The patches GPU engines get as well (``mrl.engine.server.patches``: compact routes) are installed
here too; this file takes the place of ``mrl/engine/server/shim`` on a CPU engine's path.
"""
import os
import sys

from mrl.engine.server import patches as engine_patches
from mrl.engine.server.patches import PatchOnImport

try:
    import torch

    if not torch.cuda.is_available():

        def _no_pin(fn):
            def inner(*args, **kwargs):
                kwargs.pop("pin_memory", None)
                return fn(*args, **kwargs)

            return inner

        # tensor/arange and Tensor.pin_memory: SGLang's LoRA layers and backends pin their batch metadata
        for _name in ("zeros", "empty", "ones", "full", "tensor", "arange"):
            setattr(torch, _name, _no_pin(getattr(torch, _name)))
        torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
except ImportError:
    pass


def _batched_attention(module):
    from mrl.engine.server.cpu_attention import install

    install(module)


def _no_gc_on_empty_cache(module):
    platform = getattr(module, "CpuDeviceMixin", None)
    if platform is not None and "empty_cache" in vars(platform):
        platform.empty_cache = lambda self: None


def _fork_instead_of_spawn() -> None:
    import multiprocessing

    set_method = multiprocessing.set_start_method

    def set_start_method(method, force=False):
        set_method("fork" if method == "spawn" else method, force=force)

    multiprocessing.set_start_method = set_start_method


engine_patches.install()
_fork_instead_of_spawn()
sys.meta_path.insert(0, PatchOnImport("sglang.srt.platforms.cpu", _no_gc_on_empty_cache))
if os.environ.get("MRL_CPU_BATCHED_ATTENTION") == "1":
    sys.meta_path.insert(0, PatchOnImport("sglang.srt.layers.attention.torch_native_backend", _batched_attention))
