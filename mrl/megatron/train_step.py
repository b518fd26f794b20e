"""Micro-batched forward/backward of token logprobs through megatron's schedules, with Keep Routing.

    outs = forward_backward(model, layout, mbs, vocab_size=V, loss_fn=fn, driver=replay_driver)

Each micro-batch is padded ``[b, S]`` token ids (S a multiple of tp for sequence parallelism) with
its routes ``[b, S, L, K]``; ``loss_fn(logprobs [b, S-1], mb) -> (loss, metrics)`` runs on the last
PP stage. Logits are gathered over TP and the log-softmax is taken over the real vocabulary only
(padding rows are not part of the engine's distribution).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from mrl.megatron.forward import token_logprobs
from mrl.megatron.parallel import Layout
from mrl.routing.replay import ReplayDriver
from megatron.core.pipeline_parallel import get_forward_backward_func


@dataclass
class MicroBatch:
    input_ids: torch.Tensor
    """[b, S] token ids, right-padded."""
    routes: torch.Tensor | None = None
    """[b, S, L, K] int64 expert ids aligned to input_ids (``routing.replay.align_routes``)."""
    data: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-token loss inputs ([b, S-1]: mask, old/behaviour logprobs, advantages, ...)."""


LossFn = Callable[[torch.Tensor, MicroBatch], tuple[torch.Tensor, dict[str, Any]]]


def forward_backward(model: torch.nn.Module, layout: Layout, mbs: list[MicroBatch], *, vocab_size: int,
                     loss_fn: LossFn | None = None, driver: ReplayDriver | None = None,
                     forward_only: bool = False, loss_scale: float = 1.0) -> list[dict[str, Any]]:
    """One pass over ``mbs`` (megatron's 1F1B schedule when PP > 1). Returns, on the last stage, one
    dict per micro-batch: ``logprobs`` [b, S-1] (detached) plus the loss_fn metrics; [] elsewhere.

    ``loss_fn`` losses are used as given (times ``loss_scale``): megatron's division by the number of
    micro-batches is undone here, so callers pass globally normalized losses."""
    n = len(mbs)
    seq = mbs[0].input_ids.shape[1]
    mb_size = mbs[0].input_ids.shape[0]
    if any(mb.input_ids.shape != (mb_size, seq) for mb in mbs):
        raise ValueError("all micro-batches must share one [b, S] shape (pad them)")
    it = iter(mbs)

    def forward_step(_data_iterator, m):
        mb = next(it)
        ids = mb.input_ids
        pos = torch.arange(seq, device=ids.device).unsqueeze(0).expand_as(ids)
        if driver is not None:
            driver.before_forward(mb.routes)
        out = m(input_ids=ids, position_ids=pos, attention_mask=None, runtime_gather_output=True)
        if driver is not None:
            out = driver.after_forward(out)

        def loss_func(logits):
            lp = token_logprobs(logits, ids, vocab_size)
            if loss_fn is None:
                return lp.sum() * 0.0, {"logprobs": lp.detach()}
            loss, metrics = loss_fn(lp, mb)
            return loss * (loss_scale * n), {"logprobs": lp.detach(), **metrics}

        return out, loss_func

    ctx = torch.no_grad() if forward_only else torch.enable_grad()
    try:
        with ctx:
            outs = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter([None] * n), model=[model],
                num_microbatches=n, seq_length=seq, micro_batch_size=mb_size, forward_only=forward_only)
    finally:
        if driver is not None:
            driver.close()
    return list(outs) if layout.is_last_stage else []
