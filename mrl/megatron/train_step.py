"""Micro-batched forward/backward of token logprobs through megatron's schedules, with Keep Routing.

    outs = forward_backward(model, layout, mbs, vocab_size=V, loss_fn=fn, driver=replay_driver,
                            support=SupportSpec(temperature=1.0, on_outside="drop"))

Each micro-batch is ``[b, S]`` token ids (S a multiple of tp for sequence parallelism) with its routes
``[b, S, L, K]``: one right-padded sample per row, or several samples per row (``packing``: see
``mrl.megatron.packing``). ``loss_fn(logprobs [n, T-1], mb) -> (loss, metrics)`` runs on the last PP
stage with one row per sample either way (packed logprobs are unpacked first). The log-softmax is
taken over the real vocabulary only (padding rows are not part of the engine's distribution), on the
vocab-parallel logits (two small all-reduces over TP, no gather of ``[b, S, V]``); with a sampling
support (Keep Sampling Mask) over that support only, on logits gathered over TP.

With context parallelism (``layout.cp``) each rank feeds the model its positions of every row
(``mrl.megatron.context_parallel``: megatron's load-balanced split, per packed segment for THD), replays
the routes of exactly those positions, scores them against their next tokens in sequence order, and
all-gathers the logprobs back into sequence order before ``loss_fn``: the loss sees whole sequences,
the same on every CP rank, equal to CP=1's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from mrl._compat.te import HAVE_TE
from mrl.megatron.context_parallel import LocalInputs, local_inputs
from mrl.megatron.forward import vocab_parallel_target_logprobs, vocab_parallel_token_logprobs
from mrl.megatron.packing import Packing
from mrl.megatron.parallel import GroupInfo, Layout
from mrl.routing.replay import ReplayDriver
from mrl.routing.sampling_mask import SupportSpec, support_logprobs
from megatron.core.pipeline_parallel import get_forward_backward_func


@dataclass
class MicroBatch:
    input_ids: torch.Tensor
    """[b, S] token ids: right-padded samples, or packed rows (then the shape of ``packing.grid``)."""
    routes: torch.Tensor | None = None
    """[b, S, L, K] expert ids (uint8, int32 or int64) aligned to input_ids (``routing.replay.align_routes``;
    packed the same way)."""
    data: dict[str, torch.Tensor] = field(default_factory=dict)
    """Loss inputs, one row per sample ([n, T-1]: ``mask`` (the loss mask), old/behaviour logprobs,
    advantages, ...). Unpacked, n = b and T = S."""
    packing: Packing | None = None
    """Several samples per row: where each sits, and the attention inputs that keep them apart."""
    support: torch.Tensor | None = None
    """[b, S-1, K] Keep Sampling Mask: token ids of the engine's sampling support for the token at t + 1
    (-1 = empty slot; a position with no id is not masked), in the input's row layout."""
    samples: list[int] = field(default_factory=list)
    """Whole-batch indices of the samples of ``data``'s rows, in row order."""
    cp: LocalInputs | None = None
    """Under context parallelism: this CP rank's inputs, targets and supports (``forward_backward`` makes them
    once per micro-batch)."""

    @property
    def positions(self) -> torch.Tensor | None:
        """This CP rank's sequence positions of the input, in its token order (None without CP)."""
        return self.cp.split.index if self.cp is not None else None


LossFn = Callable[[torch.Tensor, MicroBatch], tuple[torch.Tensor, dict[str, Any]]]


def _position_ids(mb: MicroBatch) -> torch.Tensor:
    ids = mb.input_ids
    if mb.packing is None:
        return torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
    return mb.packing.position_ids


def _model_inputs(mb: MicroBatch) -> dict[str, Any]:
    ids, pos = (mb.cp.input_ids, mb.cp.position_ids) if mb.cp is not None else (mb.input_ids, _position_ids(mb))
    pk = mb.packing
    if pk is None:
        return dict(input_ids=ids, position_ids=pos, attention_mask=None)
    if pk.fmt == "mask":
        if HAVE_TE:  # model.layer_spec picks TE's attention, whose causal mask type ignores a custom mask
            raise ValueError("packed rows with a block-diagonal mask need megatron's local attention; with the "
                             "Transformer Engine spec pack with fmt='thd'")
        return dict(input_ids=ids, position_ids=pos, attention_mask=pk.attention_mask)
    # THD under CP: megatron and TE take the whole micro-batch's cu_seqlens, each rank its split of the tokens
    return dict(input_ids=ids, position_ids=pos, attention_mask=None, packed_seq_params=pk.packed_seq_params)


def _split_over_cp(mb: MicroBatch, layout: Layout) -> None:
    """This CP rank's share of ``mb`` (once per micro-batch: the step's forwards reuse it)."""
    if mb.cp is not None:
        return
    pk = mb.packing
    if pk is not None and pk.fmt != "thd":
        raise ValueError(f"parallel.cp={layout.cp.size}: packed rows with a block-diagonal mask run on megatron's "
                         "local attention, which has no context parallelism; context parallelism packs in THD "
                         "(Transformer Engine)")
    cu = pk.cu_seqlens_padded if pk is not None else None
    mb.cp = local_inputs(mb.input_ids, _position_ids(mb), cu, layout.cp, support=mb.support)


def _logprobs(logits: torch.Tensor, mb: MicroBatch, vocab_size: int, support: SupportSpec | None,
              temperature: float = 1.0, tp: GroupInfo | None = None,
              fused: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-sample logprobs [n, T-1] and, under a sampling support, where the token lies outside it.
    ``logits``: vocab-parallel over ``tp`` (None: full), gathered when the micro-batch has a support.
    ``temperature``: the engine samples (and reports logprobs) from softmax(logits / T)."""
    if mb.cp is not None:
        return _cp_logprobs(logits, mb, vocab_size, support, temperature, tp, fused)
    ids = mb.input_ids
    outside = None
    if mb.support is None:
        lp = vocab_parallel_token_logprobs(logits if temperature == 1.0 else logits / temperature, ids, vocab_size,
                                           tp or GroupInfo(None, 0, 1), fused=fused)
    else:
        if support is None:
            raise ValueError("micro-batch carries a sampling support but forward_backward got no SupportSpec")
        lp, outside = support_logprobs(logits[:, :-1, :vocab_size], ids[:, 1:], mb.support, support.temperature,
                                       on_outside=support.on_outside)
    if mb.packing is not None:
        lp = mb.packing.unpack_predictions(lp)
        outside = None if outside is None else mb.packing.unpack_predictions(outside, fill=False)
    return lp, outside


def _cp_logprobs(logits: torch.Tensor, mb: MicroBatch, vocab_size: int, support: SupportSpec | None,
                 temperature: float, tp: GroupInfo | None, fused: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``_logprobs`` under context parallelism: ``logits`` cover this rank's positions; each is scored against
    its next token in sequence order, then the ranks' logprobs are gathered back into sequence order."""
    loc = mb.cp
    outside = None
    if loc.support is None:
        lp = vocab_parallel_target_logprobs(logits if temperature == 1.0 else logits / temperature, loc.targets,
                                            vocab_size, tp or GroupInfo(None, 0, 1), fused=fused)
    else:
        if support is None:
            raise ValueError("micro-batch carries a sampling support but forward_backward got no SupportSpec")
        lp, outside = support_logprobs(logits[..., :vocab_size], loc.targets, loc.support, support.temperature,
                                       on_outside=support.on_outside)
        outside = loc.split.gather(outside)[:, :-1]
    lp = loc.split.gather(lp)[:, :-1]  # [b, S - 1]: position q predicts token q + 1, as without CP
    if mb.packing is not None:
        lp = mb.packing.unpack_predictions(lp)
        outside = None if outside is None else mb.packing.unpack_predictions(outside, fill=False)
    return lp, outside


def forward_backward(model: torch.nn.Module, layout: Layout, mbs: list[MicroBatch], *, vocab_size: int,
                     loss_fn: LossFn | None = None, driver: ReplayDriver | None = None,
                     forward_only: bool = False, loss_scale: float = 1.0,
                     support: SupportSpec | None = None, temperature: float = 1.0,
                     fused_logprob: bool = True) -> list[dict[str, Any]]:
    """One pass over ``mbs`` (megatron's 1F1B schedule when PP > 1). Returns, on the last stage, one
    dict per micro-batch: ``logprobs`` [n, T-1] (detached, one row per sample) plus the loss_fn metrics;
    [] elsewhere.

    ``loss_fn`` losses are used as given (times ``loss_scale``): megatron's division by the number of
    micro-batches is undone here, so callers pass globally normalized losses. With ``support`` and
    ``on_outside="drop"``, tokens outside their support are taken out of ``data["mask"]`` before
    ``loss_fn`` sees it (metric ``outside_support_tokens``). ``temperature``: logprobs of softmax(logits / T),
    the distribution the engine sampled from (a sampling support carries its own). ``fused_logprob``:
    ``train.fused_logprob`` (``vocab_parallel_token_logprobs``)."""
    if temperature <= 0:
        raise ValueError(f"temperature {temperature}: RL samples need a temperature > 0")
    n = len(mbs)
    shape = tuple(mbs[0].input_ids.shape)
    if any(tuple(mb.input_ids.shape) != shape for mb in mbs):
        raise ValueError("all micro-batches must share one [b, S] shape (pad them)")
    if layout.cp.size > 1:
        for mb in mbs:
            _split_over_cp(mb, layout)
    it = iter(mbs)

    def forward_step(_data_iterator, m):
        mb = next(it)
        if driver is not None:
            driver.before_forward(mb.routes, mb.positions)
        # full-vocab logits only where a sampling support needs them; else the vocab-parallel log-softmax
        out = m(**_model_inputs(mb), runtime_gather_output=mb.support is not None)
        if driver is not None:
            out = driver.after_forward(out)

        def loss_func(logits):
            lp, outside = _logprobs(logits, mb, vocab_size, support, temperature, layout.tp, fused_logprob)
            extra: dict[str, Any] = {}
            batch = mb
            if outside is not None:
                extra["outside_support_tokens"] = outside.sum().float()  # only response rows carry supports
                if bool(outside.any()):
                    batch = dataclasses.replace(mb, data={**mb.data, "mask": mb.data["mask"] * ~outside})
                    lp = lp.masked_fill(outside, 0.0)  # constant: no gradient, no -inf in the loss
            if loss_fn is None:
                return lp.sum() * 0.0, {"logprobs": lp.detach(), **extra}
            loss, metrics = loss_fn(lp, batch)
            return loss * (loss_scale * n), {"logprobs": lp.detach(), **metrics, **extra}

        return out, loss_func

    ctx = torch.no_grad() if forward_only else torch.enable_grad()
    try:
        with ctx:
            outs = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter([None] * n), model=[model],
                num_microbatches=n, seq_length=shape[1], micro_batch_size=shape[0], forward_only=forward_only)
    finally:
        if driver is not None:
            driver.close()
    return list(outs) if layout.is_last_stage else []
