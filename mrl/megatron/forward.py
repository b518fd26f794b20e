"""Forward passes of a (possibly pipelined) megatron model that return full-vocab logits, and token
logprobs from full or vocab-parallel logits."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mrl._compat.te import parallel_cross_entropy
from mrl.megatron.parallel import GroupInfo, Layout
from megatron.core.pipeline_parallel import get_forward_backward_func


def forward_logits(model: torch.nn.Module, layout: Layout, input_ids: torch.Tensor) -> torch.Tensor | None:
    """Logits [B, S, padded_vocab] on the last pipeline stage (None on other stages), eval mode.

    PP > 1 goes through megatron's own forward-only schedule (p2p over gloo/NCCL), one micro-batch. Whole
    sequences on every rank: no context parallelism (the training step's forwards split them).
    """
    if layout.cp.size > 1:
        raise ValueError(f"parallel.cp={layout.cp.size}: full-vocabulary logits of whole sequences (mrl check-model, "
                         "the weight-sync probe) are computed without context parallelism; run them with "
                         "parallel.cp=1")
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


class _VocabParallelLogprob(torch.autograd.Function):
    """log softmax(logits)[target] over the real vocabulary, with the vocabulary split over a TP group
    (megatron's vocab-parallel layout: rank r holds columns ``[r * V_local, (r + 1) * V_local)``):
    two all-reduces of ``[...]`` fp32 (max; sum of exps and the target's logit) instead of gathering
    ``[..., V]`` logits. Padding columns (ids >= ``vocab_size``) are not part of the distribution and
    get zero gradient. Computed in fp32, like ``token_logprobs``."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, group):
        x = logits.float()
        if x is logits:  # fp32 already: the in-place steps below must not touch the caller's tensor
            x = x.clone()
        real = max(0, min(x.shape[-1], vocab_size - vocab_start))
        if real < x.shape[-1]:
            x[..., real:] = float("-inf")
        m = x.amax(-1)
        if group is not None:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        x.sub_(m.unsqueeze(-1))
        t = target - vocab_start
        inside = (t >= 0) & (t < real)
        t = t.clamp(0, x.shape[-1] - 1)
        picked = x.gather(-1, t.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
        x.exp_()
        total = x.sum(-1)
        if group is not None:
            both = torch.stack([total, picked])
            dist.all_reduce(both, group=group)
            total, picked = both[0], both[1]
        ctx.save_for_backward(x, total, t, inside)
        ctx.in_dtype = logits.dtype
        return picked - total.log()

    @staticmethod
    def backward(ctx, grad):
        exp, total, t, inside = ctx.saved_tensors
        # d logp / d logits = onehot(target) - softmax, on this rank's columns (in place: exp is used once)
        g = exp.div_(total.unsqueeze(-1)).mul_(-grad.unsqueeze(-1))
        g.scatter_add_(-1, t.unsqueeze(-1), (grad * inside).unsqueeze(-1))
        return g.to(ctx.in_dtype), None, None, None, None


_IGNORE = -100  # a target TE's kernel skips: the last position predicts nothing


def _fused_cross_entropy(logits: torch.Tensor):
    """TE's fused cross entropy where it runs (CUDA tensors, TE installed), else None."""
    return parallel_cross_entropy() if logits.is_cuda else None


def vocab_parallel_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, vocab_size: int,
                                  tp: GroupInfo, fused: bool = True) -> torch.Tensor:
    """``token_logprobs`` from this TP rank's vocab-parallel logits ``[B, S, V_padded / tp]`` (the model's
    output without ``runtime_gather_output``): log p(input_ids[:, t+1] | <= t), [B, S-1], over the real
    vocabulary only; equal to ``token_logprobs`` of the gathered logits up to fp32 rounding.

    ``fused`` on a GPU with Transformer Engine and unpadded vocabulary shards: TE's fused cross entropy on
    the whole ``logits`` (the last position's target ignored), which reads the bf16 logits once and, in
    backward, writes the gradient into their buffer, where the fp32 path below keeps an fp32 copy of
    them (4 bytes a logit) for backward and passes over it several times. ``logits`` must not be read
    after backward starts. Padding columns would enter TE's softmax: those shards take the fp32 path."""
    group = tp.group if tp.size > 1 else None
    ce = _fused_cross_entropy(logits) if fused else None
    if ce is not None and logits.shape[-1] * tp.size == vocab_size and logits.is_contiguous():
        target = torch.roll(input_ids, -1, dims=1).long()
        target[:, -1] = _IGNORE
        return ce(logits, target, 0.0, False, group, _IGNORE, overwrite_input=True)[:, :-1].neg()
    return _VocabParallelLogprob.apply(logits[:, :-1], input_ids[:, 1:], tp.rank * logits.shape[-1], vocab_size,
                                       group)


def vocab_parallel_target_logprobs(logits: torch.Tensor, target: torch.Tensor, vocab_size: int, tp: GroupInfo,
                                   fused: bool = True) -> torch.Tensor:
    """log p(target[:, q] | position q), ``[B, S]``, from vocab-parallel logits ``[B, S, V_padded / tp]`` with
    the targets given per position (context parallelism: a rank's next tokens are not its next positions,
    ``mrl.megatron.context_parallel.next_tokens``). Otherwise as ``vocab_parallel_token_logprobs``."""
    group = tp.group if tp.size > 1 else None
    ce = _fused_cross_entropy(logits) if fused else None
    if ce is not None and logits.shape[-1] * tp.size == vocab_size and logits.is_contiguous():
        return ce(logits, target.long(), 0.0, False, group, _IGNORE, overwrite_input=True).neg()
    return _VocabParallelLogprob.apply(logits, target, tp.rank * logits.shape[-1], vocab_size, group)
