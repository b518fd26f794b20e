"""Forward passes of a (possibly pipelined) megatron model that return full-vocab logits."""

from __future__ import annotations

import torch

from mrl.megatron.parallel import Layout
from megatron.core.pipeline_parallel import get_forward_backward_func


def forward_logits(model: torch.nn.Module, layout: Layout, input_ids: torch.Tensor) -> torch.Tensor | None:
    """Logits [B, S, padded_vocab] on the last pipeline stage (None on other stages), eval mode.

    PP > 1 goes through megatron's own forward-only schedule (p2p over gloo/NCCL), one micro-batch.
    """
    b, s = input_ids.shape
    position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)
    if layout.pp.size == 1:
        with torch.no_grad():
            return model(input_ids=input_ids, position_ids=position_ids, attention_mask=None,
                         runtime_gather_output=True)
    store: list[torch.Tensor] = []

    def forward_step(data_iterator, m):
        out = m(input_ids=input_ids, position_ids=position_ids, attention_mask=None, runtime_gather_output=True)

        def loss_func(output_tensor):
            store.append(output_tensor.detach())
            return output_tensor.new_zeros(()), {}

        return out, loss_func

    with torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([None]), model=[model], num_microbatches=1,
            seq_length=s, micro_batch_size=b, forward_only=True,
        )
    return store[0] if layout.is_last_stage else None


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """log p(input_ids[:, t+1] | <= t), [B, S-1], over the real vocabulary only (padding rows dropped)."""
    lp = torch.log_softmax(logits[..., :vocab_size].float(), dim=-1)
    return lp[:, :-1].gather(-1, input_ids[:, 1:, None]).squeeze(-1)
