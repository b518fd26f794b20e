"""Batched CPU attention (mrl.engine.server.cpu_attention) against SGLang's own per-sequence torch_native loop."""

import types

import pytest
import torch

from mrl.engine.server import cpu_attention

native = pytest.importorskip("sglang.srt.layers.attention.torch_native_backend")
LOOP = native.TorchNativeAttnBackend  # the methods as SGLang ships them (tests never install the patch here)


def _pool(seq_lens, heads_kv, dim, slots=400, seed=0):
    """A KV cache whose unused slots hold NaN (as stale memory might) and a req_to_token table that
    scatters each request over random slots, requests at random pool rows."""
    g = torch.Generator().manual_seed(seed)
    k = torch.full((slots, heads_kv, dim), float("nan"))
    v = torch.full((slots, heads_kv, dim), float("nan"))
    perm = torch.randperm(slots - 1, generator=g) + 1
    rows = torch.randperm(16, generator=g)[: len(seq_lens)]
    table = torch.zeros(16, 300, dtype=torch.int64)
    used = 0
    for row, n in zip(rows.tolist(), seq_lens):
        idx = perm[used:used + n]
        used += n
        table[row, :n] = idx
        table[row, n:] = perm[-1]  # a never-written (NaN) slot past the end, as a reused row holds
        k[idx] = torch.randn(n, heads_kv, dim, generator=g)
        v[idx] = torch.randn(n, heads_kv, dim, generator=g)
    return k, v, table, rows, torch.tensor(seq_lens)


@pytest.mark.parametrize("heads,heads_kv", [(4, 4), (4, 2)])
def test_decode_equals_sglang_loop(heads, heads_kv):
    seq_lens = [1, 7, 33, 2, 120]
    k, v, table, rows, lens = _pool(seq_lens, heads_kv, 16)
    q = torch.randn(len(seq_lens), heads, 16)
    kw = dict(scaling=0.25, enable_gqa=heads != heads_kv, causal=False)
    ref = LOOP._run_sdpa_forward_decode(None, q, torch.empty_like(q), k, v, table, rows, lens, **kw)
    out = cpu_attention.sdpa_decode(q, torch.empty_like(q), k, v, table, rows, lens, **kw)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads,heads_kv", [(4, 4), (6, 2)])
def test_extend_equals_sglang_loop(causal, heads, heads_kv):
    seq_lens = [5, 40, 9, 1, 31]
    prefix = [0, 25, 3, 0, 30]  # a fresh prompt, cached prefixes, a one-token extend
    ext = [s - p for s, p in zip(seq_lens, prefix)]
    k, v, table, rows, lens = _pool(seq_lens, heads_kv, 8, seed=1)
    q = torch.randn(sum(ext), heads, 8)
    args = (table, rows, lens, torch.tensor(prefix), torch.tensor(ext))
    kw = dict(scaling=None, enable_gqa=heads != heads_kv, causal=causal)
    ref = LOOP._run_sdpa_forward_extend(None, q, torch.empty_like(q), k, v, *args, **kw)
    out = cpu_attention.sdpa_extend(q, torch.empty_like(q), k, v, *args, **kw)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_mixed_batch_decode_rows_equal_sglang_loop():
    """--enable-mixed-chunk: one-token rows (decoding sequences) among prefills, in any order."""
    seq_lens = [90, 12, 130, 7, 60, 20]
    prefix = [89, 0, 129, 2, 59, 15]
    ext = [s - p for s, p in zip(seq_lens, prefix)]  # 1, 12, 1, 5, 1, 5
    k, v, table, rows, lens = _pool(seq_lens, 2, 8, seed=4)
    q = torch.randn(sum(ext), 4, 8)
    args = (table, rows, lens, torch.tensor(prefix), torch.tensor(ext))
    ref = LOOP._run_sdpa_forward_extend(None, q, torch.empty_like(q), k, v, *args, enable_gqa=True, causal=True)
    out = cpu_attention.sdpa_extend(q, torch.empty_like(q), k, v, *args, enable_gqa=True, causal=True,
                                    fallback=lambda *a, **kw: pytest.fail("padding is small once decodes split off"))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_extend_falls_back_to_the_loop_when_padding_would_dominate():
    seq_lens = [200, 2, 3, 1, 4, 2]  # one long prompt among short ones: padding all to 200x200 wastes 6x
    k, v, table, rows, lens = _pool(seq_lens, 2, 8, seed=2)
    q = torch.randn(sum(seq_lens), 2, 8)
    calls = []

    def loop(*a, **kw):
        calls.append(1)
        return LOOP._run_sdpa_forward_extend(None, *a, **kw)

    args = (table, rows, lens, torch.zeros(6, dtype=torch.int64), lens.clone())
    out = cpu_attention.sdpa_extend(q, torch.empty_like(q), k, v, *args, causal=True, fallback=loop)
    ref = LOOP._run_sdpa_forward_extend(None, q, torch.empty_like(q), k, v, *args, causal=True)
    assert calls == [1]
    torch.testing.assert_close(out, ref)
    cpu_attention.sdpa_extend(q[:12], torch.empty_like(q[:12]), k, v, table, rows[1:], lens[1:],
                              torch.zeros(5, dtype=torch.int64), lens[1:].clone(), causal=True, fallback=loop)
    assert calls == [1]  # short ones alone: batched
    cpu_attention.sdpa_extend(q[:5], torch.empty_like(q[:5]), k, v, table, rows[1:3], lens[1:3],
                              torch.zeros(2, dtype=torch.int64), lens[1:3].clone(), causal=True, fallback=loop)
    assert calls == [1, 1]  # two sequences: the loop is cheaper


def test_install_patches_a_backend_class_once():
    cls = type("Backend", (LOOP,), {})
    module = types.SimpleNamespace(TorchNativeAttnBackend=cls)
    cpu_attention.install(module)
    patched = cls._run_sdpa_forward_decode
    cpu_attention.install(module)
    assert cls._run_sdpa_forward_decode is patched and cls._mrl_batched
    assert LOOP._run_sdpa_forward_decode is not patched and not getattr(LOOP, "_mrl_batched", False)
    seq_lens = [3, 9]
    k, v, table, rows, lens = _pool(seq_lens, 2, 8, seed=3)
    q = torch.randn(2, 2, 8)
    out = cls._run_sdpa_forward_decode(cls.__new__(cls), q, torch.empty_like(q), k, v, table, rows, lens)
    ref = LOOP._run_sdpa_forward_decode(None, q, torch.empty_like(q), k, v, table, rows, lens)
    torch.testing.assert_close(out, ref)


def test_installed_decode_leaves_single_sequences_to_the_loop(monkeypatch):
    looped = []

    class Backend(LOOP):
        def _run_sdpa_forward_decode(self, *a, **kw):
            looped.append(a[-1].shape[0])
            return LOOP._run_sdpa_forward_decode(self, *a, **kw)

    cpu_attention.install(types.SimpleNamespace(TorchNativeAttnBackend=Backend))
    k, v, table, rows, lens = _pool([5, 9, 4], 2, 8, seed=5)
    b = Backend.__new__(Backend)
    for n in (1, 3):
        q = torch.randn(n, 2, 8)
        out = b._run_sdpa_forward_decode(q, torch.empty_like(q), k, v, table, rows[:n], lens[:n])
        torch.testing.assert_close(out, LOOP._run_sdpa_forward_decode(None, q, torch.empty_like(q), k, v, table,
                                                                      rows[:n], lens[:n]))
    assert looped == [1]


def test_installed_methods_take_sglangs_own_call():
    """The arguments exactly as SGLang's ``forward_extend`` / ``forward_decode`` pass them (``encoder_lens``
    positional, cross-attention and sliding-window keywords); a sliding window goes to SGLang's loop."""
    looped = []

    class Backend(LOOP):
        def _run_sdpa_forward_extend(self, *a, **kw):
            looped.append(kw["sliding_window_size"])
            return LOOP._run_sdpa_forward_extend(self, *a, **kw)

    cpu_attention.install(types.SimpleNamespace(TorchNativeAttnBackend=Backend))
    b = Backend.__new__(Backend)
    seq_lens, prefix = [6, 20, 11, 30], [0, 12, 4, 0]
    ext = [s - p for s, p in zip(seq_lens, prefix)]
    k, v, table, rows, lens = _pool(seq_lens, 2, 8, seed=7)
    q = torch.randn(sum(ext), 4, 8)
    args = (table, rows, lens, torch.tensor(prefix), torch.tensor(ext), None)
    kw = dict(scaling=0.3, enable_gqa=True, causal=True, is_cross_attn=False)
    out = b._run_sdpa_forward_extend(q, torch.empty_like(q), k, v, *args, **kw, sliding_window_size=None)
    ref = LOOP._run_sdpa_forward_extend(None, q, torch.empty_like(q), k, v, *args, **kw, sliding_window_size=None)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert looped == []  # batched
    win = b._run_sdpa_forward_extend(q, torch.empty_like(q), k, v, *args, **kw, sliding_window_size=4)
    torch.testing.assert_close(win, LOOP._run_sdpa_forward_extend(b, q, torch.empty_like(q), k, v, *args, **kw,
                                                                  sliding_window_size=4))
    assert looped == [4]
    qd = torch.randn(4, 4, 8)
    dkw = dict(scaling=0.3, enable_gqa=True, causal=False, is_cross_attn=False, sliding_window_size=None)
    out = b._run_sdpa_forward_decode(qd, torch.empty_like(qd), k, v, table, rows, lens, None, **dkw)
    ref = LOOP._run_sdpa_forward_decode(None, qd, torch.empty_like(qd), k, v, table, rows, lens, None, **dkw)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
