"""Loaded by the CPU engine of ``bench/gpu_loop.py --cpu`` only (its ``PYTHONPATH`` puts this folder
first), then mrl's own CPU-mode shim, which this file shadows, runs as usual.

SGLang's ``/weights_checker`` checksum action calls ``torch.cuda.synchronize()`` around its hashing,
which fails in a forked CPU-mode scheduler ("Cannot re-initialize CUDA"). With no GPU there is
nothing to wait for, so the call does nothing here: the bench's bitwise check of a sync then runs on
CPU with the same code as on GPUs.
"""
import importlib.util
import os

import torch

if not torch.cuda.is_available():
    torch.cuda.synchronize = lambda *args, **kwargs: None

_spec = importlib.util.find_spec("mrl")
_mrl_shim = os.path.join(os.path.dirname(_spec.origin), "engine", "cpu", "pyshim", "sitecustomize.py")
_mod = importlib.util.spec_from_file_location("_mrl_cpu_sitecustomize", _mrl_shim)
_mod.loader.exec_module(importlib.util.module_from_spec(_mod))
