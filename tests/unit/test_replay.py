"""Keep Routing's pure parts: alignment, per-rank slicing (SP; CP in tests/unit/test_context_parallel.py), PP
layer columns, refusals, metrics."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mrl.routing.replay import (RankSlice, ReplayError, align_routes, check_replayable, check_routes,
                                routing_disagreement, stage_moe_columns)


def test_routes_that_cannot_be_replayed_are_named():
    kw = dict(num_moe_layers=3, top_k=2, num_experts=8)
    assert check_routes(6, np.zeros((5, 3, 2), np.uint8), **kw) is None
    assert "missing" in check_routes(6, None, **kw)
    assert "(4, 3, 2) != (5, 3, 2)" in check_routes(6, np.zeros((4, 3, 2), np.uint8), **kw)
    assert "expert id 8 >= 8" in check_routes(6, np.full((5, 3, 2), 8, np.uint8), **kw)


def test_align_appends_valid_pad_rows():
    r = np.arange(2 * 3 * 2).reshape(2, 3, 2).astype(np.uint8) % 8  # 3 tokens -> 2 engine rows
    out = align_routes(r, seq_len=6, num_experts=8)
    assert out.shape == (6, 3, 2) and out.dtype == np.uint8  # the wire's type: widened on the device
    assert np.array_equal(out[:2], r)
    assert (out[2:] == np.array([0, 1])).all()  # last token + padding: valid, distinct ids
    with pytest.raises(ReplayError, match="padded to 2"):
        align_routes(r, seq_len=2, num_experts=8)
    wide = align_routes((r.astype(np.uint16) + 250), seq_len=4, num_experts=300)  # uint16 ids: int32 for torch
    assert wide.dtype == np.int32 and wide[0, 0, 0] == 250 and (wide[2:] == np.array([0, 1])).all()


def test_rank_slice_is_s_first_with_sp_chunks():
    b, s, L, k = 2, 4, 3, 2
    routes = torch.arange(b * s * L * k).reshape(b, s, L, k)
    full = RankSlice(tp_rank=0, tp_size=1, sequence_parallel=False, moe_columns=(0, 1, 2)).tokens(routes)
    # token i = s * b + b_idx
    for si in range(s):
        for bi in range(b):
            assert torch.equal(full[si * b + bi], routes[bi, si])
    r1 = RankSlice(tp_rank=1, tp_size=2, sequence_parallel=True, moe_columns=(2,)).tokens(routes)
    assert r1.shape == (s // 2 * b, 1, k)
    assert torch.equal(r1[0, 0], routes[0, 2, 2]) and torch.equal(r1[1, 0], routes[1, 2, 2])
    with pytest.raises(ReplayError, match="not divisible by tp=3"):
        RankSlice(tp_rank=0, tp_size=3, sequence_parallel=True, moe_columns=(0,)).tokens(routes)


def test_stage_columns_are_a_view_and_other_columns_an_index():
    routes = torch.arange(2 * 4 * 5 * 2).reshape(2, 4, 5, 2)
    for cols in ((1, 2, 3), (0, 2, 4), (4,)):
        rs = RankSlice(tp_rank=0, tp_size=1, sequence_parallel=False, moe_columns=cols)
        assert torch.equal(rs._columns(routes), routes[:, :, list(cols)])
        got = rs.tokens(routes)
        for j, c in enumerate(cols):
            assert torch.equal(got[:, j], routes[:, :, c].transpose(0, 1).reshape(-1, 2))
    view = RankSlice(tp_rank=0, tp_size=1, sequence_parallel=False, moe_columns=(1, 2, 3))._columns(routes)
    assert view.untyped_storage().data_ptr() == routes.untyped_storage().data_ptr()  # no copy, no index


def test_driver_hands_megatron_int64_ids_per_layer():
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from mrl.routing.replay import ReplayDriver

    RouterReplay.clear_global_router_replay_instances()
    try:
        layers = [RouterReplay() for _ in range(3)]
        cfg = SimpleNamespace(moe_enable_routing_replay=True, moe_router_fusion=False,
                              moe_router_load_balancing_type="none", moe_router_score_function="softmax")
        rs = RankSlice(tp_rank=1, tp_size=2, sequence_parallel=True, moe_columns=(0, 1, 2))
        routes = torch.randint(0, 8, (2, 4, 3, 2), dtype=torch.uint8)  # the wire's uint8
        ReplayDriver(cfg, rs).before_forward(routes)
        want = rs.tokens(routes)
        for j, layer in enumerate(layers):
            ids = layer.target_topk_idx
            assert ids.dtype == torch.long and ids.is_contiguous() and torch.equal(ids, want[:, j].long())
            assert layer.replay_backward_list == [ids]  # queued for recompute
    finally:
        RouterReplay.clear_global_router_replay_instances()


def test_stage_columns_follow_uneven_pp_and_dense_layers():
    moe_layers = (0, 1, 3)  # layer 2 dense
    assert stage_moe_columns(moe_layers, [2, 2], 0) == (0, 1)
    assert stage_moe_columns(moe_layers, [2, 2], 1) == (2,)
    assert stage_moe_columns(moe_layers, [3, 1], 1) == (2,)
    assert stage_moe_columns(moe_layers, [1, 3], 1) == (1, 2)


@pytest.mark.parametrize("bad,msg", [(dict(moe_router_fusion=True), "fused router"),
                                     (dict(moe_router_load_balancing_type="sinkhorn"), "sinkhorn"),
                                     (dict(moe_enable_routing_replay=False), "moe_enable_routing_replay")])
def test_configs_that_would_skip_replay_are_refused(bad, msg):
    cfg = dict(moe_enable_routing_replay=True, moe_router_fusion=False, moe_router_load_balancing_type="none",
               moe_router_score_function="softmax")
    check_replayable(SimpleNamespace(**cfg))
    with pytest.raises(ReplayError, match=msg):
        check_replayable(SimpleNamespace(**(cfg | bad)))


def test_disagreement_compares_expert_sets():
    a = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]]])
    b = torch.tensor([[[1, 0], [2, 4]], [[4, 5], [6, 7]]])  # same set, one differs, same, same
    assert routing_disagreement(a, b) == 0.25
    assert routing_disagreement(a, b, valid=torch.tensor([False, True])) == 0.0
