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
def optimizer_states_for_checkpoint(optimizer, host="cpu"):
    """While megatron builds a checkpoint's optimizer state (saving or loading) and loads one, TE's
    ``FusedAdam`` never holds an fp32 copy of every state on the GPU at once.

    - ``state_dict()`` answers as torch's optimizers do, with references: megatron's
      ``DistributedOptimizer.state_dict`` keeps only the inner optimizer's param groups, but TE's first
      copies every state to a new fp32 tensor on the GPU.
    - ``get_unscaled_state`` answers a state kept in lower precision (bf16 moments) with a new fp32 tensor,
      and megatron's per-rank format (``dp_reshardable``) collects one for every parameter before writing:
      8 bytes per parameter, more than a trainer GPU has left, so the save failed with an out-of-memory
      error at the end of a run. Each such copy moves to ``host`` at once; a state answered as itself (fp32,
      the int16 remainders of bf16 master weights) stays where it is. The host holds those copies until
      the checkpoint is written (or read).
    - ``set_scaled_state`` gets a value read into such a host tensor on the state's own device (TE scales
      and casts it there)."""
    import torch

    inner = [getattr(o, "optimizer", None) for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    fused = [o for o in inner if o is not None and hasattr(o, "get_unscaled_state")]
    for o in fused:
        o.state_dict = types.MethodType(torch.optim.Optimizer.state_dict, o)
        get, put = o.get_unscaled_state, getattr(o, "set_scaled_state", None)

        def get_unscaled_state(param, name, _o=o, _get=get):
            value, kept = _get(param, name), _o.state[param][name]
            if value.untyped_storage().data_ptr() == kept.untyped_storage().data_ptr():
                return value  # the state itself: no copy to move
            return value.to(host)

        def set_scaled_state(param, name, value, _o=o, _put=put):
            kept = _o.state.get(param, {}).get(name)
            return _put(param, name, value.to(kept.device if kept is not None else param.device))

        o.get_unscaled_state = get_unscaled_state
        if put is not None:
            o.set_scaled_state = set_scaled_state
    try:
        yield
    finally:
        for o in fused:
            for attr in ("state_dict", "get_unscaled_state", "set_scaled_state"):
                vars(o).pop(attr, None)
