"""Transformer Engine: optional (GPU only). ``HAVE_TE`` tells whether megatron's TE spec can be used."""

try:  # TE is never required; CPU boxes and CI do not have it
    import transformer_engine  # noqa: F401
    import transformer_engine.pytorch  # noqa: F401

    HAVE_TE = True
except Exception:  # ImportError, or a TE build that does not match the CUDA/torch present
    HAVE_TE = False
