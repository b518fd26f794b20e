"""The trainer's warm-up pass (``train.warmup_pass``): one forward and backward of a full-size micro-batch of
random tokens, thrown away, before the first RL step.

A GPU trainer's first step pays once for what later steps reuse: kernel selection and compilation
(cuDNN attention graphs, TE's fused kernels, torch.compile'd helpers), the caching allocator's growth to
the step's peak: a first step takes more than twice as long as the next ones (docs/gpu.md has the
figures). The loop runs this pass while its engines boot and produce the first batch, so those costs
leave the path to the first step.

It leaves no trace in training: no optimizer step (every step zeroes the gradient buffers before it
accumulates, and this pass zeroes them too), natural routing (no replay driver), tokens from its own
generator (no RNG stream of the run advances), and every module buffer put back as it was (megatron's
gradient finalization may update a router's expert bias; mrl's bridges set its update rate to 0, this
keeps it so whatever the model).
"""

from __future__ import annotations

import random

import torch

from mrl.algo import compute_policy_loss
from mrl.megatron import compat
from mrl.megatron.batch import RLBatch
from mrl.megatron.train_step import forward_backward


def warm_up(policy) -> None:
    """One thrown-away forward and backward of ``policy`` on every rank (all take part in its collectives)."""
    cfg, layout = policy.cfg, policy.layout
    t = cfg.train
    length = max(4, (t.pack_max_len // 2) if t.packing and t.pack_max_len else cfg.rollout.max_new_tokens + 32)
    rng = random.Random(cfg.seed)
    vocab = policy.bridge.vocab_size
    n = 2 * t.micro_batch_size * layout.dp.size  # packed: two samples a row, micro_batch_size rows a DP rank
    tokens = [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]
    prompt = length // 4
    batch = RLBatch(tokens=tokens, prompt_lens=[prompt] * n,
                    behav_logp=[[-1.0] * (length - prompt) for _ in range(n)],
                    advantages=[1.0 if i % 2 else -1.0 for i in range(n)], routes=None)
    mbs, _ = policy.micro_batches(batch, False)  # the whole batch on every rank: each plans its own share
    norm = torch.full((), float(n * (length - prompt)), dtype=torch.float32, device=compat.DEVICE)

    def loss_fn(lp, mb):
        d = mb.data
        return compute_policy_loss(lp, lp.detach(), d["behav"], d["adv"], d["mask"], cfg.algo, normalizer=norm)

    buffers = {name: b.detach().clone() for name, b in policy.module.named_buffers()}
    policy.model.zero_grad_buffer()
    try:
        forward_backward(policy.model, layout, mbs[:1], vocab_size=vocab, loss_fn=loss_fn,
                         loss_scale=float(layout.dp.size), temperature=policy.temperature,
                         fused_logprob=policy.fused_logprob)
    finally:
        with torch.no_grad():
            for name, b in policy.module.named_buffers():
                b.copy_(buffers[name])
        policy.model.zero_grad_buffer()
        policy.optimizer.zero_grad()
    if compat.HAS_CUDA:
        torch.cuda.synchronize()  # its kernels done before the loop marks the trainer warm
