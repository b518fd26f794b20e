"""SGLang CPU engines, MLA models (DeepSeek-V3): the prefill over the k/v the model passes (``extend_given_kv``)
against plain causal softmax attention per sequence, q/k head dim != v head dim as in MLA."""

from types import SimpleNamespace

import pytest
import torch

from mrl.engine.server.cpu_attention import extend_given_kv


def test_prefill_attends_over_the_given_keys_and_values():
    g = torch.Generator().manual_seed(0)
    heads, dk, dv, lens = 4, 24, 16, [5, 1, 7]
    T = sum(lens)
    q, k, v = (torch.randn(T, heads * d, generator=g) for d in (dk, dk, dv))
    layer = SimpleNamespace(tp_q_head_num=heads, tp_k_head_num=heads, tp_v_head_num=heads, qk_head_dim=dk,
                            v_head_dim=dv, scaling=0.3)
    batch = SimpleNamespace(extend_seq_lens=torch.tensor(lens), extend_prefix_lens=torch.zeros(3, dtype=torch.long))
    out = extend_given_kv(q, k, v, layer, batch)
    assert out.shape == (T, heads * dv)
    start = 0
    for n in lens:
        qs, ks, vs = (x[start:start + n].view(n, heads, -1).transpose(0, 1) for x in (q, k, v))
        scores = (qs @ ks.transpose(1, 2)) * 0.3
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        want = (scores.softmax(-1) @ vs).transpose(0, 1).reshape(n, heads * dv)
        assert torch.allclose(out[start:start + n], want, atol=1e-6)
        start += n


def test_prefill_with_a_cached_prefix_is_refused():
    layer = SimpleNamespace(tp_q_head_num=1, tp_k_head_num=1, tp_v_head_num=1, qk_head_dim=2, v_head_dim=2, scaling=1.0)
    batch = SimpleNamespace(extend_seq_lens=torch.tensor([2]), extend_prefix_lens=torch.tensor([3]))
    with pytest.raises(NotImplementedError, match="prefix"):
        extend_given_kv(torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(2, 2), layer, batch)
