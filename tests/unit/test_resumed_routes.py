"""Routes of a partial rollout resumed across a weight sync (``RolloutManager``, against the fake server).

After the sync the engine recomputes the resumed request's whole prefix under the new weights (its cache
was flushed), so it routes the prefix anew: the sample must hold those routes for every row, not the
old weights' routes for the rows routed before the sync. Replaying the old rows, the trainer computed
the prefix differently from the engine, and tokens sampled by its own weights no longer matched the
engine's logprobs (the numerics part of the mismatch split, mrl.megatron.mismatch)."""

from __future__ import annotations

import asyncio
import base64

import numpy as np

from mrl.sglang.client import EngineClient
from mrl.rollout.manager import RolloutManager
from mrl.rollout.sample import SamplingSpec
from tests.fakes import fake_sglang
from tests.fakes.fake_sglang import FakeSGLang
from tests.unit.test_rollout_fake import CODEC, PROMPT, greedy_reference

ORIGINAL = fake_sglang.routes_b64


def routes_of_version(ids, st, start=0):
    """The fake's routes, shifted by the engine's weight version: new weights route differently."""
    r = np.frombuffer(base64.b64decode(ORIGINAL(ids, st, 0)), dtype="<i4").reshape(len(ids), st.num_layers,
                                                                                     st.top_k)
    r = (r + int(st.weight_version)) % st.num_experts
    return base64.b64encode(np.ascontiguousarray(r[start:]).tobytes()).decode()


def expected(ids, version):
    st = fake_sglang.FakeState(weight_version=str(version))
    raw = np.frombuffer(base64.b64decode(routes_of_version(ids, st)), dtype="<i4")
    return raw.reshape(len(ids), st.num_layers, st.top_k)


def test_a_sample_resumed_across_a_sync_holds_the_new_weights_routes_for_every_row(monkeypatch):
    monkeypatch.setattr(fake_sglang, "routes_b64", routes_of_version)
    n_new = 150

    async def go(srv):
        client = EngineClient(srv.url)
        mgr = RolloutManager([client], sampling=SamplingSpec(max_new_tokens=n_new), codec=CODEC,
                             max_inflight_per_engine=2)
        task = asyncio.create_task(mgr.generate_group(PROMPT, n=4, group_id=0))
        await asyncio.sleep(0.1)
        await mgr.drain(timeout=10)  # two in flight are cut, two wait at the gate
        await client.flush_cache()
        await client.update_weight_version("1", abort_all_requests=False)
        mgr.undrain()
        return await task

    with FakeSGLang() as srv:
        samples = asyncio.run(go(srv))
    ref = greedy_reference(PROMPT, n_new)
    resumed = [s for s in samples if s.num_aborts]
    assert len(resumed) == 2
    for s in samples:
        assert s.error is None and s.response_ids == ref
        assert s.routes.shape == (len(PROMPT) + n_new - 1, 3, 2)
        # every row as the engine last routed it: the version-1 weights, prefix included
        np.testing.assert_array_equal(s.routes, expected(s.tokens[:-1], 1).astype(s.routes.dtype))
    for s in resumed:  # the tokens keep their own versions
        k = s.versions.index(1)
        assert 0 < k < n_new and s.versions == [0] * k + [1] * (n_new - k)


def test_without_a_sync_later_calls_ask_only_for_the_rows_they_add(monkeypatch):
    """The common case stays cheap: a sample's later calls (here forced by a tiny per-call budget) with no
    drain between ask for the new rows only, and the rows join up as one routing."""
    asked = []

    def recording(ids, st, start=0):
        asked.append(start)
        return routes_of_version(ids, st, start)

    monkeypatch.setattr(fake_sglang, "routes_b64", recording)

    async def go(srv):
        client = EngineClient(srv.url)
        mgr = RolloutManager([client], sampling=SamplingSpec(max_new_tokens=4), codec=CODEC)
        s = (await mgr.generate_group(PROMPT, n=1, group_id=0))[0]
        turn = await mgr.generate_turn(s, 3)  # a second call on the same sample, same weights
        return s, turn

    with FakeSGLang() as srv:
        s, turn = asyncio.run(go(srv))
    assert turn == "length" and len(s.response_ids) == 7
    assert asked == [0, len(PROMPT) + 4 - 1]  # the second call starts at the rows already held
    np.testing.assert_array_equal(s.routes, expected(s.tokens[:-1], 0).astype(s.routes.dtype))
