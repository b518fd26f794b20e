"""Transformer Engine: optional (GPU only). ``HAVE_TE`` tells whether megatron's TE spec can be used."""

try:  # TE is never required; CPU boxes and CI do not have it
    import transformer_engine  # noqa: F401
    import transformer_engine.pytorch  # noqa: F401

    HAVE_TE = True
except Exception:  # ImportError, or a TE build that does not match the CUDA/torch present
    HAVE_TE = False


def trainer_spec() -> str:
    """The megatron layer spec this process trains with (the run's summary.json records it)."""
    return "transformer_engine" if HAVE_TE else "local"


def fuse_wgrad_accumulation(module) -> int:
    """Let every TE layer of ``module`` accumulate its weight gradients straight into megatron DDP's
    ``main_grad`` buffers inside its own GEMM (TE's ``fuse_wgrad_accumulation``) instead of returning one
    gradient per weight for DDP's hook to add: a grouped MoE layer otherwise costs an add kernel and a
    Python hook per expert per micro-batch, which leaves the GPU waiting on the host. Megatron turns this
    on only through ``gradient_accumulation_fusion``, which it refuses without apex's CUDA extension
    because its own (non-TE) linears need it; those keep the plain path. Call once DDP has wrapped the
    module (its ``main_grad`` buffers must exist). Returns how many TE layers fuse now."""
    if not HAVE_TE:
        return 0
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    n = 0
    for m in module.modules():
        if not isinstance(m, TransformerEngineBaseModule):
            continue
        weights = [p for p in m.parameters(recurse=False) if p.requires_grad]
        if weights and all(hasattr(p, "main_grad") for p in weights):
            m.fuse_wgrad_accumulation = True
            n += 1
    return n
