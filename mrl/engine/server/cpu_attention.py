"""Batched attention for SGLang's ``torch_native`` backend, the only one SGLang runs on a CPU here.

SGLang's backend loops over the sequences of a batch in Python and calls SDPA once per sequence and
layer. On a CPU engine that loop is most of the scheduler's time at batch 64 (about half, measured
with py-spy), so the engine's cost grows linearly with its batch -- unlike a real GPU engine, whose
attention kernels take the whole batch at once. These functions do the same attention for the whole
batch in one SDPA call over a padded ``[batch, heads, q, kv]`` problem, with a mask that keeps each
sequence to its own keys (and causal in prefill). Same arguments and results as the methods they
replace (``TorchNativeAttnBackend._run_sdpa_forward_decode`` / ``_extend``, SGLang 0.5.14 signatures);
tests compare the two. Encoder-decoder (cross) attention and sliding windows, which no model mrl
trains uses, go to SGLang's loop.

Loaded only inside SGLang server processes in mrl's CPU mode: the pyshim's ``sitecustomize`` calls
:func:`install` when SGLang imports its backend and ``MRL_CPU_BATCHED_ATTENTION`` is ``1`` (the
launcher's default; ``engine.cpu_batched_attention=false`` keeps SGLang's loop). Never imported by
the trainer.
"""

from __future__ import annotations

import sys

import torch
from torch.nn.functional import scaled_dot_product_attention

EXTEND_PAD_LIMIT = 4.0
"""A prefill batch is padded to its longest sequence; when that would cost more than this many times
the attention scores the sequences need (one long prompt among short ones), the per-sequence loop is
cheaper and is used instead."""

SMALL_BATCH = 2
"""Prefill batches of up to this many sequences, and single-sequence decodes, stay with SGLang's loop:
the mask and gather cost more there than the loop they replace (micro-benchmark: one-sequence decode
60 us looped, 84 us batched; two-sequence prefill 173 / 196 us; from 8 sequences on the batched path
is 2-4x faster)."""

TARGET_MODULE = "sglang.srt.layers.attention.torch_native_backend"
INSTALLED_MARK = "mrl: SGLang torch_native attention batched (mrl.engine.server.cpu_attention)"
"""Printed to the engine's log by :func:`install`, so a run (and the tests) can tell which path ran."""


def _gather_kv(k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, dtype):
    """Keys and values of every sequence, padded to the longest: ``[B, Hkv, L, D]`` each, plus the
    ``[B, L]`` validity mask. Padded positions read the sequence's first key (always written), not
    whatever an unused cache slot holds: a NaN there would leak through a masked softmax (0 * NaN)."""
    max_len = int(seq_lens.max())
    pos = torch.arange(max_len, device=seq_lens.device)
    valid = pos[None, :] < seq_lens[:, None]
    slots = req_to_token[req_pool_indices, :max_len]
    slots = torch.where(valid, slots, slots[:, :1]).reshape(-1)
    shape = (valid.shape[0], max_len) + tuple(k_cache.shape[1:])
    # index_select on the flat slot list: half the time of advanced indexing with a 2-D index
    k = k_cache.index_select(0, slots).view(shape).transpose(1, 2)
    v = v_cache.index_select(0, slots).view(shape[:2] + tuple(v_cache.shape[1:])).transpose(1, 2)
    if k.dtype != dtype:
        k, v = k.to(dtype), v.to(dtype)
    return k, v, valid


def _unsupported(encoder_lens, is_cross_attn, sliding_window_size) -> bool:
    return encoder_lens is not None or is_cross_attn or sliding_window_size is not None


def sdpa_decode(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, encoder_lens=None,
                scaling=None, enable_gqa=False, causal=False, is_cross_attn=False, sliding_window_size=None,
                fallback=None):
    """One new token per sequence: query ``[B, H, D]`` attends to its sequence's ``seq_len`` cached keys.
    ``fallback`` (the per-sequence loop, same arguments) runs for a single sequence."""
    if seq_lens.shape[0] == 0:
        return output
    if fallback is not None and (seq_lens.shape[0] == 1 or
                                 _unsupported(encoder_lens, is_cross_attn, sliding_window_size)):
        return fallback(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                        encoder_lens=encoder_lens, scaling=scaling, enable_gqa=enable_gqa, causal=causal,
                        is_cross_attn=is_cross_attn,
                        sliding_window_size=sliding_window_size)
    if _unsupported(encoder_lens, is_cross_attn, sliding_window_size):
        raise NotImplementedError("batched CPU attention: cross attention and sliding windows take SGLang's loop")
    k, v, valid = _gather_kv(k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, query.dtype)
    out = scaled_dot_product_attention(query.unsqueeze(2), k, v, attn_mask=valid[:, None, None, :],
                                       scale=scaling, enable_gqa=enable_gqa)
    output.copy_(out.squeeze(2))
    return output


def sdpa_extend(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, extend_prefix_lens,
                extend_seq_lens, encoder_lens=None, scaling=None, enable_gqa=False, causal=False, is_cross_attn=False,
                sliding_window_size=None, fallback=None):
    """Prefill: sequence ``b`` brings ``extend_seq_lens[b]`` new tokens (``query`` holds them back to back)
    after ``extend_prefix_lens[b]`` cached ones. ``fallback`` (the per-sequence loop, same arguments) runs
    for :data:`SMALL_BATCH` sequences or fewer and when padding would waste more than
    :data:`EXTEND_PAD_LIMIT`."""
    n = seq_lens.shape[0]
    if n == 0:
        return output
    if _unsupported(encoder_lens, is_cross_attn, sliding_window_size):
        if fallback is None:
            raise NotImplementedError("batched CPU attention: cross attention and sliding windows take SGLang's loop")
        return fallback(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, extend_prefix_lens,
                        extend_seq_lens, encoder_lens=encoder_lens, scaling=scaling, enable_gqa=enable_gqa,
                        causal=causal, is_cross_attn=is_cross_attn, sliding_window_size=sliding_window_size)
    one = extend_seq_lens == 1
    if bool(one.any()) and not bool(one.all()):
        # a mixed batch (--enable-mixed-chunk: decoding sequences ride along with a prefill): the one-token
        # rows take the decode path, so the prefill's length does not pad them
        first = torch.cumsum(extend_seq_lens, 0) - extend_seq_lens  # each sequence's first query row
        rows = first[one]
        output[rows] = sdpa_decode(query[rows], torch.empty_like(output[rows]), k_cache, v_cache, req_to_token,
                                   req_pool_indices[one], seq_lens[one], scaling=scaling, enable_gqa=enable_gqa)
        rest = torch.repeat_interleave(~one, extend_seq_lens)
        output[rest] = sdpa_extend(query[rest], torch.empty_like(output[rest]), k_cache, v_cache, req_to_token,
                                   req_pool_indices[~one], seq_lens[~one], extend_prefix_lens[~one],
                                   extend_seq_lens[~one], scaling=scaling, enable_gqa=enable_gqa, causal=causal,
                                   fallback=fallback)
        return output
    ext = extend_seq_lens.tolist()
    kv = seq_lens.tolist()
    max_q, max_kv = max(ext), max(kv)
    needed = sum(q * k for q, k in zip(ext, kv))
    if fallback is not None and (n <= SMALL_BATCH or n * max_q * max_kv > EXTEND_PAD_LIMIT * max(needed, 1)):
        return fallback(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                        extend_prefix_lens, extend_seq_lens, scaling=scaling, enable_gqa=enable_gqa, causal=causal)
    k, v, valid = _gather_kv(k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, query.dtype)
    qpos = torch.arange(max_q, device=query.device)
    q_valid = qpos[None, :] < extend_seq_lens[:, None]  # [B, Q]
    q = query.new_zeros((n, max_q) + query.shape[1:])
    q[q_valid] = query
    mask = valid[:, None, :].expand(n, max_q, valid.shape[1])  # [B, Q, L]
    if causal:
        absolute = extend_prefix_lens[:, None] + qpos[None, :]  # [B, Q]: position of each query token
        kpos = torch.arange(valid.shape[1], device=query.device)
        # key 0 stays visible to padded query rows, so no row is fully masked (NaN); they are dropped below
        mask = mask & (kpos[None, None, :] <= absolute[:, :, None])
    out = scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[:, None], scale=scaling,
                                       enable_gqa=enable_gqa)
    output.copy_(out.transpose(1, 2)[q_valid])
    return output


def extend_given_kv(q, k, v, layer, forward_batch):
    """Prefill attention over the ``k`` / ``v`` the model passes (per head), not over the KV cache.

    For MLA models (DeepSeek-V3) SGLang prefills through an MHA path that hands the backend per-head keys
    and values with ``save_kv_cache=False`` while the cache holds the compressed latents
    (``deepseek_common/attention_forward_methods/forward_mha.py``); SGLang 0.5.14's torch_native
    ``forward_extend`` attends over the cache regardless, i.e. over the latents: wrong output (the
    tiny DeepSeek-V3's shapes hide it). That path runs only without a cached prefix."""
    if bool((forward_batch.extend_prefix_lens != 0).any()):  # SGLang picks this path only without a prefix
        raise NotImplementedError("MLA prefill with given k/v and a cached prefix: SGLang's path choice changed; "
                           "the keys of the cached prefix are not in k/v")
    heads, dk, dv = layer.tp_q_head_num, layer.qk_head_dim, layer.v_head_dim
    q, k, v = q.view(-1, heads, dk), k.view(-1, layer.tp_k_head_num, dk), v.view(-1, layer.tp_v_head_num, dv)
    out = q.new_empty((q.shape[0], heads, dv))
    start = 0
    for n in forward_batch.extend_seq_lens.tolist():
        sl = slice(start, start + n)
        out[sl] = scaled_dot_product_attention(
            q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1), is_causal=True, scale=layer.scaling,
            enable_gqa=heads != layer.tp_k_head_num).transpose(0, 1)
        start += n
    return out.reshape(q.shape[0], heads * dv)


def install(module=None) -> None:
    """Route SGLang's ``TorchNativeAttnBackend`` through the batched functions (idempotent)."""
    if module is None:
        import importlib

        module = importlib.import_module(TARGET_MODULE)
    cls = module.TorchNativeAttnBackend
    if getattr(cls, "_mrl_batched", False):
        return
    loop_extend, loop_decode = cls._run_sdpa_forward_extend, cls._run_sdpa_forward_decode

    def _extend(self, *args, **kwargs):
        return sdpa_extend(*args, **kwargs, fallback=lambda *a, **k: loop_extend(self, *a, **k))

    def _decode(self, *args, **kwargs):
        return sdpa_decode(*args, **kwargs, fallback=lambda *a, **k: loop_decode(self, *a, **k))

    cls._run_sdpa_forward_extend = _extend
    cls._run_sdpa_forward_decode = _decode
    loop_forward_extend = cls.forward_extend

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, *args, **kwargs):
        mla_cache = hasattr(self.token_to_kv_pool, "kv_lora_rank")  # MLATokenToKVPool: latents, not k/v
        if save_kv_cache or not mla_cache or k is None or v is None or layer.is_cross_attention:
            return loop_forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache, *args, **kwargs)
        return extend_given_kv(q, k, v, layer, forward_batch)

    cls.forward_extend = forward_extend
    cls._mrl_batched = True
    print(INSTALLED_MARK, file=sys.stderr, flush=True)
