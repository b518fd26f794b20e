"""Sequence packing: first-fit-decreasing plans, the packed layouts, and packed == unpacked through
megatron's real local attention (in-process tiny model: logprobs and gradients, replayed routes)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mrl.megatron.packing import (Packing, PackingError, first_fit_decreasing,
                                  pack_micro_batches, split_rows)
from tests.conftest import one_rank_gloo_world


def test_first_fit_decreasing_fills_rows_longest_first():
    lengths = [5, 3, 7, 2, 9, 1, 4]
    bins = first_fit_decreasing(lengths, capacity=10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert bins == [[4, 5], [2, 1], [0, 6], [3]]  # 9+1, 7+3, 5+4, 2
    assert first_fit_decreasing(lengths, capacity=10) == bins  # deterministic: every rank plans alike
    with pytest.raises(PackingError, match="does not fit"):
        first_fit_decreasing([11], capacity=10)


def test_split_rows_is_even():
    assert split_rows(7, 3) == [3, 2, 2]
    assert split_rows(2, 2) == [1, 1]


def _ids(lengths):
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = 100 * (i + 1) + torch.arange(n)
    return ids


def test_pack_and_unpack_round_trip_with_block_diagonal_causal_mask():
    lengths = [5, 3, 7, 2]
    pk = Packing.build(lengths, first_fit_decreasing(lengths, 10), row_len=10, num_rows=3)
    ids = pk.pack_tokens(_ids(lengths), fill=0)
    assert ids.shape == (3, 10) and pk.grid == (3, 10)
    assert ids[0].tolist() == [300, 301, 302, 303, 304, 305, 306, 200, 201, 202]  # 7 + 3
    assert ids[2].tolist() == [0] * 10  # an empty row (every micro-batch shares one shape)
    # position t of the prediction grid predicts t + 1: unpacking the inputs shifted by one gives
    # each sample's own next tokens, never a neighbour's
    nxt = pk.unpack_predictions(ids[:, 1:])
    for i, n in enumerate(lengths):
        assert nxt[i, :n - 1].tolist() == (100 * (i + 1) + torch.arange(1, n)).tolist()
        assert (nxt[i, n - 1:] == 0).all()
    m = pk.attention_mask  # [b, 1, S, S], True = masked
    assert m.shape == (3, 1, 10, 10) and m.dtype == torch.bool
    allowed = ~m[0, 0]
    assert allowed[:7, :7].equal(torch.ones(7, 7, dtype=torch.bool).tril())  # causal inside sample 2
    assert not allowed[7:, :7].any() and not allowed[:7, 7:].any()  # nothing across samples
    assert allowed[9, 7] and not allowed[7, 9]
    assert (~m[1, 0]).diagonal().all()  # row tails attend to themselves: no fully masked softmax row
    assert pk.position_ids[0].tolist() == list(range(7)) + [0, 1, 2]
    assert pk.cu_seqlens_padded.tolist() == [0, 7, 10, 15, 17, 20, 30]  # samples, tail of row 1, empty row


def test_predictions_pack_like_tokens_and_slots_align():
    lengths = [5, 3]
    pk = Packing.build(lengths, [[0, 1]], row_len=16, align=4)
    assert pk.slot == [8, 4] and pk.offset == [0, 8]
    assert pk.cu_seqlens_padded.tolist() == [0, 8, 12, 16]
    per_sample = torch.arange(2 * 4).view(2, 4) + 1  # [n, T-1]
    grid = pk.pack_predictions(per_sample, fill=-1)
    assert grid.shape == (1, 15)
    assert grid[0, :4].tolist() == [1, 2, 3, 4] and grid[0, 8:10].tolist() == [5, 6]
    assert grid[0, 4:8].tolist() == [-1] * 4  # the last token and its slot padding predict nothing
    with pytest.raises(PackingError, match="multiple of the slot alignment"):
        Packing.build(lengths, [[0, 1]], row_len=15, align=4)


def _scatter_by_index(x, idx, numel, shape, fill):
    """The layouts' definition: every valid index of ``idx`` gets its sample's value, the rest ``fill``."""
    out = torch.as_tensor(fill, dtype=x.dtype).expand(numel, *x.shape[2:]).clone()
    keep = idx >= 0
    out[idx[keep]] = x[:, :idx.shape[1]][keep]
    return out.reshape(*shape, *x.shape[2:])


@pytest.mark.parametrize("fmt", ["mask", "thd"])
def test_placement_by_slices_equals_the_index_layouts(fmt, monkeypatch):
    """pack_tokens / pack_predictions copy each sample as one slice; the result is exactly the scatter
    through ``token_index`` / ``_prediction_index`` (random plans, slot alignment, empty rows, routes-like
    ``[n, T, L, K]`` values)."""
    import mrl.megatron.packing as packing

    monkeypatch.setattr(packing, "HAVE_TE", True)  # building the THD layout's host side needs no kernel
    rng = np.random.default_rng(3)
    for trial in range(20):
        align = int(rng.choice([1, 2, 4]))
        lengths = rng.integers(2, 24, size=int(rng.integers(1, 9))).tolist()
        row_len = packing.round_up(max(packing.round_up(n, align) for n in lengths) + int(rng.integers(0, 9)), align)
        bins = first_fit_decreasing([packing.round_up(n, align) for n in lengths], row_len)
        pk = Packing.build(lengths, bins, row_len=row_len, num_rows=len(bins) + int(rng.integers(0, 2)), fmt=fmt,
                           align=align)
        b, s = pk.grid
        x = torch.from_numpy(rng.integers(0, 200, size=(len(lengths), max(lengths), 3, 2)).astype(np.uint8))
        fill = torch.arange(2, dtype=torch.uint8)
        assert pk.pack_tokens(x, fill).equal(_scatter_by_index(x, pk.token_index(), b * s, (b, s), fill)), trial
        xp = torch.from_numpy(rng.standard_normal((len(lengths), max(lengths) - 1)).astype(np.float32))
        want = _scatter_by_index(xp, pk._prediction_index(), b * (s - 1), (b, s - 1), -1.0)
        assert pk.pack_predictions(xp, -1.0).equal(want), trial


def test_thd_needs_transformer_engine():
    from mrl._compat.te import HAVE_TE

    if HAVE_TE:
        pytest.skip("Transformer Engine present: the THD path is available")
    with pytest.raises(PackingError, match="needs Transformer Engine"):
        Packing.build([3, 2], [[0, 1]], row_len=6, fmt="thd")


def test_thd_parameters_count_real_tokens_and_slots(monkeypatch):
    # the THD parameters TE's attention reads, built here without TE (megatron's PackedSeqParams is plain)
    from mrl.megatron import packing

    monkeypatch.setattr(packing, "HAVE_TE", True)
    unaligned = Packing.build([5, 3], [[0, 1]], row_len=10, fmt="thd")
    p = unaligned.packed_seq_params
    assert p.cu_seqlens_q.tolist() == [0, 5, 8, 10]  # the row's tail is a segment of its own
    assert p.cu_seqlens_q_padded is None and p.max_seqlen_q == 5 and p.total_tokens == 10
    aligned = Packing.build([5, 3], [[0, 1]], row_len=16, align=4, fmt="thd")
    p = aligned.packed_seq_params
    assert p.cu_seqlens_q.tolist() == [0, 5, 8, 12] and p.cu_seqlens_q_padded.tolist() == [0, 8, 12, 16]
    assert aligned.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 0, 1, 2, 3]]


def test_every_dp_rank_gets_the_same_number_of_micro_batches():
    # rank 0: four short samples (1 row); rank 1: four long ones (4 rows)
    lengths = [3, 3, 3, 3, 9, 9, 9, 9]
    plans = [pack_micro_batches(lengths, dp_size=2, dp_rank=r, row_len=12, rows_per_micro_batch=2) for r in (0, 1)]
    assert [len(p) for p in plans] == [2, 2]  # rank 0 splits its one full row to keep EP in lockstep
    for r, plan in enumerate(plans):
        assert len({pk.grid for _, pk in plan}) == 1  # one [b, S] shape per rank
        assert sorted(i for idx, _ in plan for i in idx) == list(range(4 * r, 4 * r + 4))
        for idx, pk in plan:
            assert pk.length == [lengths[i] for i in idx]


# -- packed == unpacked through megatron's local attention (in-process tiny model) ----------------------

@pytest.fixture(scope="module")
def gloo_world():
    with one_rank_gloo_world():
        yield


@pytest.fixture(scope="module")
def tiny(ckpt_dir, gloo_world):
    from mrl.jobs.common import load_model

    return load_model(SimpleNamespace(hf=ckpt_dir["tiny"], tp=1, pp=1, ep=1, etp=None, pp_first=None, pp_last=None,
                                      dispatcher="alltoall", dtype="fp32"))


def _step(m, mbs, driver):
    from mrl.megatron.train_step import forward_backward

    m.model.zero_grad(set_to_none=True)
    outs = forward_backward(m.model, m.layout, mbs, vocab_size=m.bridge.vocab_size, driver=driver,
                            loss_fn=lambda lp, mb: (-(lp * mb.data["mask"]).sum(), {}))
    grads = {n: p.grad.clone() for n, p in m.model.named_parameters() if p.grad is not None}
    return [row for o in outs for row in o["logprobs"]], grads


def test_packed_rows_equal_unpacked_samples_logprobs_and_grads(tiny):
    from mrl.megatron.train_step import MicroBatch
    from mrl.routing.codec import RoutesCodec
    from mrl.routing.replay import RankSlice, ReplayDriver, ReplayMode, align_routes

    codec = RoutesCodec.from_bridge(tiny.bridge)
    g = torch.Generator().manual_seed(0)
    lengths = [9, 4, 12, 6, 3, 7]
    ids = torch.randint(1, tiny.bridge.vocab_size, (len(lengths), max(lengths)), generator=g)
    mask = torch.zeros(len(lengths), max(lengths) - 1)
    for i, n in enumerate(lengths):
        ids[i, n:] = 0
        mask[i, 1:n - 1] = 1.0  # "response": every prediction but the first
    rng = np.random.default_rng(0)  # replayed routes unlike the natural ones: packing must move them along
    routes = torch.from_numpy(np.stack([align_routes(
        np.stack([[rng.permutation(codec.num_experts)[:codec.top_k] for _ in codec.moe_layers] for _ in range(n - 1)]),
        max(lengths), codec.num_experts) for n in lengths]))
    driver = ReplayDriver(tiny.cfg, RankSlice(tp_rank=0, tp_size=1, sequence_parallel=False,
                                              moe_columns=tuple(range(len(codec.moe_layers)))), ReplayMode.replay)
    tiny.model.train()
    flat = [MicroBatch(ids[j:j + 3], routes[j:j + 3], {"mask": mask[j:j + 3]}) for j in (0, 3)]
    lp_flat, g_flat = _step(tiny, flat, driver)

    packed = []
    fill = torch.arange(codec.top_k) % codec.num_experts
    for j in (0, 3):
        n = lengths[j:j + 3]
        pk = Packing.build(n, first_fit_decreasing(n, 16), row_len=16, num_rows=2)
        w = pk.width
        packed.append(MicroBatch(pk.pack_tokens(ids[j:j + 3, :w], 0), pk.pack_tokens(routes[j:j + 3, :w], fill),
                                 {"mask": mask[j:j + 3, :w - 1]}, packing=pk))
    assert [mb.input_ids.shape for mb in packed] == [(2, 16), (2, 16)]  # 6 samples in 4 rows (one empty)
    lp_packed, g_packed = _step(tiny, packed, driver)
    for i, n in enumerate(lengths):  # every sample, every prediction: equal up to float rounding
        assert torch.allclose(lp_packed[i][:n - 1], lp_flat[i][:n - 1], atol=2e-6, rtol=0), i
    assert g_flat.keys() == g_packed.keys()
    worst = max(float((g_flat[k] - g_packed[k]).abs().max() / g_flat[k].abs().max().clamp(min=1e-12)) for k in g_flat)
    assert worst < 1e-4, worst


def _supports(batch, vocab, seed):
    """Synthetic engine supports: 5 ids per response token, the sampled one among them."""
    g = np.random.default_rng(seed)
    sup, mass = [], []
    for toks, p in zip(batch.tokens, batch.prompt_lens):
        rows = []
        for tok in toks[p:]:
            rows.append(sorted({int(tok), *g.choice(vocab, 4, replace=False).tolist()}))
        sup.append(rows)
        mass.append((-g.random(len(rows))).tolist())
    return sup, mass


def test_policy_rl_step_is_the_same_packed_or_not(ckpt_dir, gloo_world):
    """The trainer's own step (``Policy.rl_step``: replayed routes, Keep Sampling Mask, GRPO loss, optimizer)
    from the same weights on the same batch: packing changes float rounding only."""
    from mrl.config.load import compose
    from tests.jobs.resume_check import synthetic_batch
    from mrl.megatron.parallel import init_parallel
    from mrl.megatron.policy import Policy

    results = {}
    for packing, mask in ((False, True), (True, True), (True, False)):
        cfg = compose([f"model.hf_path={ckpt_dir['tiny']}", "algo.lr=1e-3", "train.micro_batch_size=2",
                       f"train.packing={str(packing).lower()}", "train.pack_max_len=24",
                       f"train.sampling_mask={str(mask).lower()}", "train.bad_support=mask", "rollout.top_k=5"])
        policy = Policy(cfg, init_parallel(cfg.parallel, seed=cfg.seed), ckpt_dir["tiny"])
        c = policy.codec
        batch = synthetic_batch(0, 8, policy.bridge.vocab_size, len(c.moe_layers), c.top_k, c.num_experts)
        batch.support, batch.support_log_mass = _supports(batch, policy.bridge.vocab_size, 0)
        batch.support[3][1] = []  # one support the engine's top logprobs could not decide: out of the loss
        mbs, _ = policy.micro_batches(batch, True)
        m = policy.rl_step(batch, float(sum(len(t) - p for t, p in zip(batch.tokens, batch.prompt_lens))))
        params = torch.cat([p.detach().flatten() for p in policy.module.parameters()])
        results[packing, mask] = (m, params, [tuple(mb.input_ids.shape) for mb in mbs])
    (m_off, p_off, shapes_off), (m_on, p_on, shapes_on) = results[False, True], results[True, True]
    assert len(shapes_off) == 4 and len(shapes_on) < 4 and {s for s in shapes_on} == {(2, 24)}  # it packed
    assert m_on["support_unknown_tokens"] == m_off["support_unknown_tokens"] == 1.0
    assert m_on["outside_support_tokens"] == 0.0
    # rl_step reports pg_loss as the mean of the micro-batches' shares of the loss: compare the sums
    assert m_on["pg_loss"] * len(shapes_on) == pytest.approx(m_off["pg_loss"] * len(shapes_off), rel=1e-4)
    assert m_on["grad_norm"] == pytest.approx(m_off["grad_norm"], rel=1e-4)
    assert float((p_on - p_off).abs().max()) < 1e-5
    assert results[True, False][0]["grad_norm"] != pytest.approx(m_on["grad_norm"], rel=1e-2)  # the mask is live
