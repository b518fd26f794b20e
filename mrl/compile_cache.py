"""Where torch inductor and triton keep what they compile, for the processes mrl starts: SGLang engines
(prefill CUDA graphs, MoE and attention kernels: ``engine.compile_cache_dir``) and trainer ranks
(megatron's torch.compile'd helpers, TE's and mrl's triton kernels: ``train.compile_cache_dir``). By
default both caches live under /tmp, which a cluster job or a container loses when it ends, so every job
on a fresh node compiles everything again before its first step."""

from __future__ import annotations

import os


def cache_env(compile_cache_dir: str | None) -> dict[str, str]:
    """The environment that puts both caches under ``compile_cache_dir`` ({} for None); callers only
    ``setdefault`` it, so a caller's own ``TORCHINDUCTOR_CACHE_DIR`` / ``TRITON_CACHE_DIR`` win."""
    if not compile_cache_dir:
        return {}
    root = os.path.abspath(os.path.expanduser(compile_cache_dir))
    return {"TORCHINDUCTOR_CACHE_DIR": os.path.join(root, "inductor"), "TRITON_CACHE_DIR": os.path.join(root, "triton")}
