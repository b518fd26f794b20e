"""Loaded only by SGLang server processes in mrl's CPU mode (PYTHONPATH set by the launcher).

SGLang's routed-experts host buffer asks for pinned memory unconditionally
(srt/layers/moe/routed_experts_capturer.py); without a driver, pinning fails with "Found no NVIDIA
driver". On a host without CUDA, tensor factories ignore ``pin_memory``. Never imported by the trainer.

With ``MRL_CPU_BATCHED_ATTENTION=1`` SGLang's ``torch_native`` attention backend is switched to
``mrl.rollout.cpu_attention`` (one SDPA call per batch instead of one per sequence) as soon as SGLang
imports it: a hook on the import, so processes that never load SGLang's model code (the resource
tracker) do not pay for importing it.
"""
import os
import sys

try:
    import torch

    if not torch.cuda.is_available():

        def _no_pin(fn):
            def inner(*args, **kwargs):
                kwargs.pop("pin_memory", None)
                return fn(*args, **kwargs)

            return inner

        for _name in ("zeros", "empty", "ones", "full"):
            setattr(torch, _name, _no_pin(getattr(torch, _name)))
except ImportError:
    pass


class _BatchedAttentionHook:
    """Meta-path finder that lets SGLang's backend module load as usual, then patches it."""

    target = "sglang.srt.layers.attention.torch_native_backend"

    def find_spec(self, name, path=None, target=None):
        if name != self.target:
            return None
        import importlib.util

        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            from mrl.rollout.cpu_attention import install

            install(module)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("MRL_CPU_BATCHED_ATTENTION") == "1":
    sys.meta_path.insert(0, _BatchedAttentionHook())
