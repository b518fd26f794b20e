"""Loaded only by SGLang server processes in mrl's CPU mode (PYTHONPATH set by the launcher).

SGLang's routed-experts host buffer asks for pinned memory unconditionally
(srt/layers/moe/routed_experts_capturer.py); without a driver, pinning fails with "Found no NVIDIA
driver". On a host without CUDA, tensor factories ignore ``pin_memory``. Never imported by the trainer.
"""
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
