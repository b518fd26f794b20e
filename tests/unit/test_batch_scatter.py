"""The batch-delivery codec (``mrl.megatron.batch_scatter``): a DP rank's share of a step's batch through one
flat byte buffer and back, every field kind, and the checks on what cannot travel."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from mrl.megatron.batch import RLBatch, WholeBatch, dp_share
from mrl.megatron.batch_scatter import ALIGN, decode, encode, layout, make_header, share_of


def make_batch(n: int = 8, *, routes_dtype=np.uint8, support: bool = True, loss_mask: bool = True,
               seed: int = 0) -> RLBatch:
    """Ragged samples with every optional field: supports of 0-5 ids per token, some empty (not rebuilt)."""
    g = np.random.default_rng(seed)
    tokens, plens, behav, routes, sup, mass, masks, vers = [], [], [], [], [], [], [], []
    for _ in range(n):
        p, r = int(g.integers(2, 6)), int(g.integers(1, 9))
        tokens.append(g.integers(0, 151_000, p + r).tolist())
        plens.append(p)
        behav.append((-g.random(r) * 4).tolist())
        routes.append(g.integers(0, 128 if routes_dtype == np.uint8 else 100_000, (p + r - 1, 3, 2))
                      .astype(routes_dtype))
        sup.append([sorted(g.choice(151_000, int(g.integers(0, 6)), replace=False).tolist()) for _ in range(r)])
        mass.append((-g.random(r)).tolist())
        masks.append(g.integers(0, 2, r).tolist())
        vers.append(np.sort(g.integers(3, 6, r)).tolist())  # a partial rollout's tokens span versions
    return RLBatch(tokens=tokens, prompt_lens=plens, behav_logp=behav, advantages=g.normal(size=n).tolist(),
                   routes=routes, support=sup if support else None, support_log_mass=mass if support else None,
                   loss_mask=masks if loss_mask else None, versions=vers,
                   token_advantages=[g.normal(size=len(b)).tolist() for b in behav],
                   ref_logp=[(-g.random(len(b)) * 3).tolist() for b in behav])


def assert_same_samples(got: RLBatch, want: RLBatch) -> None:
    for name in ("tokens", "prompt_lens", "behav_logp", "advantages", "support", "support_log_mass", "loss_mask",
                 "versions", "token_advantages", "ref_logp"):
        assert getattr(got, name) == getattr(want, name), name  # floats compared exactly
    assert (got.routes is None) == (want.routes is None)
    for a, b in zip(got.routes or [], want.routes or []):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert (got.first, got.whole) == (want.first, want.whole)


@pytest.mark.parametrize("routes_dtype", [np.uint8, np.int32])
@pytest.mark.parametrize("dp", [1, 2, 4])
def test_every_share_round_trips_exactly(routes_dtype, dp):
    batch = make_batch(routes_dtype=routes_dtype)
    header = make_header(batch, 37.0, {"reward": 0.25}, dp)
    for r in range(dp):
        share = dp_share(len(batch), dp, r)
        got = decode(header, share, encode(batch, header, share))
        want = share_of(batch, header, share)
        assert len(got) == len(batch) // dp and got.first == share.start
        assert_same_samples(got, want)
        assert [a.dtype for a in got.routes] == [np.dtype(routes_dtype)] * len(got)
        assert got.whole == WholeBatch.of(batch)  # the plan's figures are the whole batch's, not the share's


def test_none_fields_stay_none():
    batch = make_batch(support=False, loss_mask=False)
    batch.routes = batch.versions = batch.token_advantages = batch.ref_logp = None
    header = make_header(batch, 1.0, {}, 2)
    assert [f.name for f in header.fields] == ["tokens", "behav_logp"]
    got = decode(header, range(4, 8), encode(batch, header, range(4, 8)))
    assert got.routes is got.support is got.support_log_mass is got.loss_mask is got.versions is None
    assert got.token_advantages is got.ref_logp is None
    assert_same_samples(got, share_of(batch, header, range(4, 8)))


def test_ragged_supports_keep_empty_and_single_id_tokens():
    batch = make_batch(n=2)
    batch.support[1] = [[], [7], [], [3, 4]] + batch.support[1][4:]
    batch.support_log_mass[1] = batch.support_log_mass[1][:len(batch.support[1])]
    batch.support[0] = []  # a sample with no response token supports at all
    batch.support_log_mass[0] = []
    header = make_header(batch, 1.0, {}, 1)
    got = decode(header, range(2), encode(batch, header, range(2)))
    assert got.support == batch.support and got.support_log_mass == batch.support_log_mass
    assert header.whole.support_unknown == sum(not kept for s in batch.support for kept in s)


def test_a_share_carries_its_own_samples_only_in_their_dtypes():
    """The buffer of a share is the bytes of its samples' fields (plus alignment), uint8 routes one byte per
    expert id; the header does not grow with the batch's tokens."""
    for dtype, itemsize in ((np.uint8, 1), (np.int32, 4)):
        batch = make_batch(n=8, routes_dtype=dtype, support=False, loss_mask=False)
        header = make_header(batch, 1.0, {}, 2)
        share = dp_share(8, 2, 1)
        segments, size = layout(header, share)
        want = sum(len(batch.tokens[i]) * 4 + len(batch.behav_logp[i]) * 8 + batch.routes[i].size * itemsize
                   + len(batch.versions[i]) * 4 + len(batch.token_advantages[i]) * 8 + len(batch.ref_logp[i]) * 8
                   for i in share)
        assert want <= size < want + len(segments) * ALIGN
        assert all(offset % ALIGN == 0 for _, offset, _ in segments)
    long = make_batch(n=8)
    long.tokens = [t * 50 for t in long.tokens]
    small = len(pickle.dumps(make_header(make_batch(), 1.0, {}, 2)))
    assert len(pickle.dumps(make_header(long, 1.0, {}, 2))) < 2 * small


def test_bad_batches_fail_naming_the_field():
    batch = make_batch()
    batch.tokens[3][0] = 2**40
    with pytest.raises(ValueError, match=r"tokens: sample 3 holds 1099511627776, outside int32"):
        encode(batch, make_header(batch, 1.0, {}, 2), range(0, 4))
    batch = make_batch()
    batch.routes[5] = batch.routes[5].astype(np.int32)
    with pytest.raises(ValueError, match=r"RLBatch.routes: .* one dtype"):
        make_header(batch, 1.0, {}, 2)
    with pytest.raises(ValueError, match="batch of 8 samples does not split over dp=3"):
        make_header(make_batch(), 1.0, {}, 3)
    batch = make_batch()
    batch.loss_mask = batch.loss_mask[:7]
    with pytest.raises(ValueError, match="RLBatch.loss_mask has 7 entries for 8 samples"):
        make_header(batch, 1.0, {}, 2)
    batch = make_batch()
    batch.loss_mask[2][0] = 300
    with pytest.raises(ValueError, match="loss_mask: sample 2 holds 300, outside uint8"):
        encode(batch, make_header(batch, 1.0, {}, 1), range(8))
    share = share_of(batch, make_header(make_batch(), 1.0, {}, 2), range(4, 8))
    with pytest.raises(ValueError, match=r"sample 2 is not in this batch \(it holds samples 4..7"):
        share.local(2)


def test_a_one_rank_world_sends_and_pickles_nothing(monkeypatch):
    import torch.distributed as dist

    from mrl.megatron.batch_scatter import BatchScatter

    mine = not dist.is_initialized()
    if mine:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        def refuse(*args, **kwargs):
            raise AssertionError("a one-rank world communicated")

        for name in ("broadcast_object_list", "all_gather_object", "isend", "irecv", "send", "recv"):
            monkeypatch.setattr(dist, name, refuse)
        monkeypatch.setattr(pickle, "dumps", refuse)
        item = (make_batch(), 3.0, {"reward": 1.0})
        scatter = BatchScatter(dp_rank=0, dp_size=1, group=dist.group.WORLD)
        assert scatter.deliver(item, what="the step-1 batch") is item
    finally:
        monkeypatch.undo()
        if mine:
            dist.destroy_process_group()
