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


def te_linear_kinds() -> dict[type, str]:
    """megatron's Transformer Engine linear classes that LoRA can wrap -> ``column``, ``row``, ``grouped_column``
    or ``grouped_row`` (``column_norm``: the input norm is fused into the linear); empty without TE."""
    if not HAVE_TE:
        return {}
    from megatron.core.extensions import transformer_engine as mte

    kinds = {mte.TELayerNormColumnParallelLinear: "column_norm", mte.TEColumnParallelLinear: "column",
             mte.TERowParallelLinear: "row"}
    grouped = (("TEColumnParallelGroupedLinear", "grouped_column"), ("TERowParallelGroupedLinear", "grouped_row"))
    for name, kind in grouped:
        if hasattr(mte, name):  # defined only where TE has GroupedLinear
            kinds[getattr(mte, name)] = kind
    return kinds
