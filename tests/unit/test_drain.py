"""Draining the rollout manager before a weight sync (``RolloutManager.drain``), against the fake server.

SGLang 0.5.10's ``pause_generation(mode=abort)`` polls for running requests once a second, so the loop
empties the engines itself first: in-flight requests are aborted (partials kept), new ones wait, and
after ``undrain`` the samples resume -- equal to uninterrupted ones, each token with its version.
"""

import asyncio

from mrl.sglang.client import EngineClient
from mrl.rollout.manager import RolloutManager
from mrl.rollout.sample import SamplingSpec
from tests.fakes.fake_sglang import FakeSGLang
from tests.unit.test_rollout_fake import CODEC, PROMPT, greedy_reference


def test_drain_aborts_in_flight_holds_new_requests_and_resumes_them():
    async def go(srv):
        client = EngineClient(srv.url)
        # 5 samples but 2 slots: 3 wait on the manager's semaphore and must not slip past the drain
        mgr = RolloutManager([client], sampling=SamplingSpec(max_new_tokens=150), codec=CODEC,
                             max_inflight_per_engine=2)
        task = asyncio.create_task(mgr.generate_group(PROMPT, n=5, group_id=0))
        await asyncio.sleep(0.1)
        aborted = await mgr.drain(timeout=10)
        calls = srv.st.generate_calls
        await asyncio.sleep(0.3)  # drained: nothing reaches the engine, nothing is running there
        idle = (srv.st.generate_calls == calls, len(srv._inflight), sum(s.inflight for s in mgr.slots))
        t0 = asyncio.get_running_loop().time()
        await client.pause("abort")  # nothing in flight: returns at once
        pause_s = asyncio.get_running_loop().time() - t0
        await client.update_weight_version("1", abort_all_requests=False)
        await client.resume()
        mgr.undrain()
        return mgr, aborted, idle, pause_s, await task

    with FakeSGLang() as srv:
        mgr, aborted, idle, pause_s, samples = asyncio.run(go(srv))
    assert aborted == 2
    assert idle == (True, 0, 0)
    assert pause_s < 0.5
    ref = greedy_reference(PROMPT, 150)
    for s in samples:
        assert s.error is None and s.response_ids == ref
        assert len(s.versions) == 150 and s.versions[-1] == 1
        k = s.versions.index(1)
        assert s.versions == [0] * k + [1] * (150 - k)  # each token keeps the version that produced it
    assert sum(s.num_aborts for s in samples) == 2  # only the two that were running were cut
    assert mgr.stats.failed == 0 and mgr.stats.completed == 5


def test_drain_times_out_naming_the_engine():
    """An engine that ignores aborts: the drain fails with the URL and the count, it does not hang."""

    async def go(srv):
        client = EngineClient(srv.url)
        mgr = RolloutManager([client], sampling=SamplingSpec(max_new_tokens=600), codec=CODEC)
        task = asyncio.create_task(mgr.generate_group(PROMPT, n=1, group_id=0))
        await asyncio.sleep(0.1)
        srv._loop.call_soon_threadsafe(srv._inflight.clear)  # the engine forgets the request: aborts miss it
        try:
            await mgr.drain(timeout=0.3)
        except TimeoutError as e:
            return str(e)
        finally:
            task.cancel()
        return None

    with FakeSGLang() as srv:
        msg = asyncio.run(go(srv))
    assert msg is not None and "1 requests still in flight" in msg and srv.url in msg

