"""Client guards, rollout manager and injected faults, against the fixture-shaped fake server.

Faults: crash mid-request, hang, 400, 503, malformed bodies, partial weight update. Each gives a
clear error or a retry on another engine, and no sample is lost (samples in = samples out).
"""

import asyncio

import pytest

from mrl.sglang.client import ClientTimeouts, EngineClient
from mrl.rollout.manager import RolloutManager
from mrl.sglang.protocol import EngineGuardError, EngineHTTPError, EngineProtocolError, EngineUnavailable
from mrl.rollout.sample import SamplingSpec
from mrl.routing.codec import RoutesCodec
from tests.fakes.fake_sglang import FakeSGLang, Faults, next_token

CODEC = RoutesCodec(num_layers=3, top_k=2, num_experts=8, moe_layers=(0, 1, 2))
FAULT_NAMES = {"crash_after": "crashes mid-request", "hang": "hangs", "http_503": "answers 503",
               "http_400": "answers 400", "malformed": "answers malformed JSON"}
PROMPT = [1, 17, 42, 99, 7]


def run(coro):
    return asyncio.run(coro)


def greedy_reference(prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(next_token(ids, 512))
    return ids[len(prompt):]


def test_generate_roundtrip_and_version_probe():
    async def go(url):
        c = EngineClient(url)
        out = await c.generate(PROMPT, {"max_new_tokens": 6}, rid="r1", return_routed_experts=True)
        assert out.output_ids == greedy_reference(PROMPT, 6) and len(out.output_logprobs) == 6
        assert CODEC.decode(out.routed_experts, prompt_len=5, response_len=6).shape == (10, 3, 2)
        assert (await c.server_info())["version"] == "0.5.10" and await c.weight_version() == "0"
        await c.close()

    with FakeSGLang() as srv:
        run(go(srv.url))


def test_guards_never_send_server_killing_calls():
    async def go(url, st):
        c = EngineClient(url)
        with pytest.raises(EngineGuardError, match="not created by this client"):
            await c.update_weights_from_distributed(names=["lm_head.weight"], dtypes=["float32"],
                                                    shapes=[[512, 64]], group_name="nope")
        assert st.received == [] and not st.dead  # nothing reached the server
        with pytest.raises(ValueError, match="one payload per engine TP rank"):
            await c.update_weights_from_tensor([])
        await c.init_weights_update_group(master_address="127.0.0.1", master_port=1, rank_offset=1,
                                          world_size=2, group_name="g1", backend="gloo")
        await c.pause("retract")
        with pytest.raises(EngineGuardError, match="retract"):
            await c.update_weights_from_distributed(names=["a"], dtypes=["float32"], shapes=[[1]],
                                                    group_name="g1", flush_cache=True)
        with pytest.raises(EngineGuardError, match="flush"):
            await c.flush_cache()
        with pytest.raises(EngineGuardError, match="paused"):
            await c.health()
        await c.resume()
        with pytest.raises(ValueError, match="torch"):
            await c.update_weights_from_distributed(names=["a"], dtypes=["torch.float32"], shapes=[[1]],
                                                    group_name="g1")
        with pytest.raises(ValueError, match="one request per sample"):
            await c.generate(PROMPT, {"n": 2}, rid="x")
        msg = await c.update_weights_from_distributed(names=["a"], dtypes=["float32"], shapes=[[1]],
                                                      group_name="g1", weight_version="3")
        assert "updated to 3" in msg and await c.weight_version() == "3"
        await c.destroy_weights_update_group("g1")
        with pytest.raises(EngineHTTPError, match="does not exist"):
            await c.destroy_weights_update_group("g1")
        await c.close()

    with FakeSGLang() as srv:
        run(go(srv.url, srv.st))


def test_group_samples_have_per_token_provenance():
    async def go(urls):
        mgr = RolloutManager([EngineClient(u) for u in urls], sampling=SamplingSpec(max_new_tokens=12), codec=CODEC)
        groups = await asyncio.gather(*(mgr.generate_group(PROMPT + [g], n=4, group_id=g) for g in range(3)))
        return mgr, [s for g in groups for s in g]

    with FakeSGLang() as a, FakeSGLang() as b:
        mgr, samples = run(go([a.url, b.url]))
        assert a.st.generate_calls > 0 and b.st.generate_calls > 0  # least-loaded dispatch used both
    assert len(samples) == 12 and mgr.stats.completed == 12
    for s in samples:
        assert s.response_ids == greedy_reference(s.prompt_ids, 12) and s.finish_reason == "length"
        assert s.versions == [0] * 12 and s.routes.shape == (len(s.prompt_ids) + 11, 3, 2)


def test_stop_token_ends_a_sample():
    ref = greedy_reference(PROMPT, 8)

    async def go(url):
        mgr = RolloutManager([EngineClient(url)], sampling=SamplingSpec(max_new_tokens=8, stop_token_ids=[ref[3]]))
        return (await mgr.generate_group(PROMPT, 1, 0))[0]

    with FakeSGLang() as srv:
        s = run(go(srv.url))
    assert s.finish_reason == "stop" and s.response_ids == ref[:4]


def test_partial_rollout_survives_a_weight_update_with_versions():
    """pause(abort) -> version bump -> continue: partials resume, tokens keep the version that made them."""

    async def go(srv):
        client = EngineClient(srv.url)
        mgr = RolloutManager([client], sampling=SamplingSpec(max_new_tokens=200), codec=CODEC)
        task = asyncio.create_task(mgr.generate_group(PROMPT, n=3, group_id=0))
        await asyncio.sleep(0.1)
        await asyncio.gather(*(s.client.pause("abort") for s in mgr.slots))
        await client.flush_cache()
        await client.init_weights_update_group(master_address="127.0.0.1", master_port=1, rank_offset=1,
                                               world_size=2, group_name="g", backend="gloo")
        await client.update_weights_from_distributed(names=["x"], dtypes=["float32"], shapes=[[1]],
                                                     group_name="g", weight_version="1")
        await asyncio.gather(*(s.client.resume() for s in mgr.slots))
        return mgr, await task

    with FakeSGLang() as srv:
        mgr, samples = run(go(srv))
    for s in samples:
        assert s.response_ids == greedy_reference(PROMPT, 200)  # resume == uninterrupted
        k = s.versions.index(1)
        assert 0 < k < 200 and s.versions == [0] * k + [1] * (200 - k)
        assert s.num_aborts == 1 and s.num_segments == 2
        assert s.routes.shape == (5 + 199, 3, 2)
    assert mgr.stats.aborted_segments == 3


@pytest.mark.parametrize("faults,kind", [
    (Faults(crash_after=1), EngineUnavailable),
    (Faults(hang=True), EngineUnavailable),
    (Faults(http_503=True), EngineUnavailable),
    (Faults(malformed="null_logprob"), EngineProtocolError),
    (Faults(malformed="no_meta"), EngineProtocolError),
    (Faults(malformed="not_json"), EngineProtocolError),
    (Faults(http_400=True), EngineHTTPError),
])
@pytest.mark.reliability
def test_client_turns_each_fault_into_a_clear_error(faults, kind, reliability):
    async def go(url):
        c = EngineClient(url, timeouts=ClientTimeouts(generate=1.0))
        with pytest.raises(kind) as e:
            await c.generate(PROMPT, {"max_new_tokens": 6}, rid="f1")
        assert url in str(e.value) and "/generate" in str(e.value)
        await c.close()
        return str(e.value)

    with FakeSGLang(faults=faults) as srv:
        msg = run(go(srv.url))
    fault = next(f"{FAULT_NAMES[k]} ({v})" if k == "malformed" else FAULT_NAMES[k]
                 for k, v in vars(faults).items() if v and k in FAULT_NAMES)
    reliability.record(category="fault", name=f"engine /generate {fault}: the error", survived=True,
                       injected=f"fake SGLang server: /generate {fault}",
                       expected=f"{kind.__name__} naming the engine and the endpoint",
                       message=msg.replace(srv.url, "http://<engine>"))


@pytest.mark.parametrize("faults", [Faults(crash_after=2, crash_after_tokens=3), Faults(hang=True),
                                    Faults(http_503=True), Faults(malformed="null_logprob")],
                         ids=["crash", "hang", "503", "malformed"])
@pytest.mark.reliability
def test_faulty_engine_is_bypassed_and_no_sample_is_lost(faults, reliability):
    async def go(bad, good):
        clients = [EngineClient(bad, timeouts=ClientTimeouts(generate=1.0)), EngineClient(good)]
        mgr = RolloutManager(clients, sampling=SamplingSpec(max_new_tokens=10), codec=CODEC)
        groups = await asyncio.gather(*(mgr.generate_group(PROMPT + [g], n=4, group_id=g) for g in range(4)))
        return mgr, [s for g in groups for s in g]

    with FakeSGLang(faults=faults) as bad, FakeSGLang() as good:
        mgr, samples = run(go(bad.url, good.url))
    assert len(samples) == 16 and mgr.stats.submitted == 16
    assert mgr.stats.completed == 16 and mgr.stats.failed == 0  # all finished on the healthy engine
    assert mgr.stats.engine_failures >= 1 and mgr.stats.retries >= 1
    assert not mgr.slots[0].healthy and mgr.slots[1].healthy
    for s in samples:
        assert s.response_ids == greedy_reference(s.prompt_ids, 10)
        s.check()
    fault = next(FAULT_NAMES[k] for k, v in vars(faults).items() if v and k in FAULT_NAMES)
    reliability.record(category="fault", name=f"1 of 2 engines {fault} during rollouts", survived=True,
                       injected=f"fake SGLang servers: one {fault} on /generate, 16 samples in 4 groups",
                       expected="engine taken out of rotation, its samples retried on the other, none lost",
                       message=f"{mgr.stats.engine_failures} engine failure(s), {mgr.stats.retries} retries",
                       samples={"generated": mgr.stats.submitted, "trained": None, "dropped": 0,
                                "failed": mgr.stats.failed, "retried": mgr.stats.retries,
                                "lost": mgr.stats.submitted - mgr.stats.completed - mgr.stats.failed})


def test_all_engines_dead_fails_samples_loudly_but_returns_them():
    async def go(url):
        mgr = RolloutManager([EngineClient(url)], sampling=SamplingSpec(max_new_tokens=5))
        return mgr, await mgr.generate_group(PROMPT, n=3, group_id=0)

    with FakeSGLang(faults=Faults(crash_after=1, crash_after_tokens=0)) as srv:
        mgr, samples = run(go(srv.url))
    assert len(samples) == 3 and mgr.stats.failed == 3 and mgr.stats.completed == 0
    assert all("no healthy engine" in s.error for s in samples)


def test_bad_request_is_not_retried():
    async def go(url):
        mgr = RolloutManager([EngineClient(url)], sampling=SamplingSpec(max_new_tokens=5))
        return mgr, await mgr.generate_group(PROMPT, n=2, group_id=0)

    with FakeSGLang(faults=Faults(http_400=True)) as srv:
        mgr, samples = run(go(srv.url))
        assert srv.st.generate_calls == 2
    assert mgr.stats.failed == 2 and all("top_p" in s.error for s in samples)


def test_partial_weight_update_is_reported():
    async def go(url):
        c = EngineClient(url)
        await c.init_weights_update_group(master_address="127.0.0.1", master_port=1, rank_offset=1,
                                          world_size=2, group_name="g", backend="gloo")
        with pytest.raises(EngineHTTPError, match="partially updated"):
            await c.update_weights_from_distributed(names=["lm_head.weight"], dtypes=["float32"],
                                                    shapes=[[10, 64]], group_name="g", weight_version="bad")
        assert await c.weight_version() == "0"  # version not stamped on failure

    with FakeSGLang(faults=Faults(partial_update=True)) as srv:
        run(go(srv.url))


def test_token_ids_outside_the_vocabulary_are_refused_and_counted():
    """A reply with a token id at or above the model's vocabulary is never trained on: the sample is
    retried (counted) and, when every reply is bad, fails naming the cause."""
    async def go(url, vocab):
        mgr = RolloutManager([EngineClient(url)], sampling=SamplingSpec(max_new_tokens=5), max_retries=2,
                             vocab_size=vocab)
        return mgr, await mgr.generate_group(PROMPT, n=2, group_id=0)

    with FakeSGLang() as srv:
        mgr, samples = run(go(srv.url, None))
        top = max(t for s in samples for t in s.tokens[len(s.prompt_ids):])
        mgr, samples = run(go(srv.url, top))  # the largest id the engine sends is one past the vocabulary
    assert mgr.stats.retries >= 2 and any(s.error for s in samples)
    assert all("outside the vocabulary" in s.error for s in samples if s.error), [s.error for s in samples]
