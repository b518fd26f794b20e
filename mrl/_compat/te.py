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
