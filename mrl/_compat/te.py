"""Transformer Engine: optional (GPU only). ``HAVE_TE`` tells whether megatron's TE spec can be used."""

import contextlib
import functools
import types

try:  # TE is never required; CPU boxes and CI do not have it
    import transformer_engine  # noqa: F401
    import transformer_engine.pytorch  # noqa: F401

    HAVE_TE = True
except Exception:  # ImportError, or a TE build that does not match the CUDA/torch present
    HAVE_TE = False


@functools.cache  # looked up once: every micro-batch's loss asks
def parallel_cross_entropy():
    """TE's fused cross entropy (``transformer_engine.pytorch.parallel_cross_entropy``: triton kernels, one
    pass over bf16 logits in fp32 arithmetic, the TP shards' statistics all-gathered), or None without TE
    or where TE's version lacks ``overwrite_input`` (the gradient written into the logits' own buffer)."""
    if not HAVE_TE:
        return None
    import inspect

    from transformer_engine.pytorch import cross_entropy

    fn = getattr(cross_entropy, "parallel_cross_entropy", None)
    return fn if fn is not None and "overwrite_input" in inspect.signature(fn).parameters else None


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


@contextlib.contextmanager
def optimizer_states_by_reference(optimizer):
    """While megatron builds a checkpoint's sharded state dict, TE's ``FusedAdam`` answers ``state_dict()``
    as torch's optimizers do, with references to its states.

    megatron's ``DistributedOptimizer.state_dict`` keeps only the inner optimizer's param groups and drops
    its states, but TE's ``FusedAdam.state_dict`` first copies every state to a new fp32 tensor on the GPU:
    with bf16 states that is twice the model's size in fp32 at once, more than a full trainer GPU has left,
    and the save fails with an out-of-memory error at the end of the run. The parameter states themselves
    are written per parameter by megatron's sharded path, which reads each through TE's own accessors."""
    import torch

    inner = [getattr(o, "optimizer", None) for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    fused = [o for o in inner if o is not None and hasattr(o, "get_unscaled_state")]
    for o in fused:
        o.state_dict = types.MethodType(torch.optim.Optimizer.state_dict, o)
    try:
        yield
    finally:
        for o in fused:
            del o.state_dict
