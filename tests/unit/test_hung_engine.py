"""Hung engines: up, accepting connections, answering nothing (SIGSTOP, a wedged server) or only 5xx.

Against the fake server, in this process or as a process of its own that the tests SIGSTOP (its kernel
still accepts connections, as for a stopped SGLang server):

- the liveness verdict (``client.liveness``): refused, silent past the probe's limit, or 5xx to every
  probe is dead; a paused or merely slow engine is alive;
- a control call to a hung engine ends with ``EngineHung`` after about a second plus the probe's limit
  (``client.watched``), not its own 60 s;
- the rollout manager: requests in flight on an engine stopped mid-rollout, or during a drain, are
  abandoned and their samples finish on the other engine (none lost);
- the weight sync drops a hung or 5xx-only engine (``FullWeightChannel.verdict``) and syncs the others, sends it
  no teardown, and still fails naming an engine that answers its probe but not the pause;
- ``Engine.kill``/``stop`` end a stopped process group at once, and a dead engine is killed before its
  replacement starts (``EngineRestarter.replace``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from mrl.sglang.client import EngineClient, close_clients, liveness, watched
from mrl.rollout.manager import RolloutManager
from mrl.sglang.protocol import EngineHung
from mrl.rollout.sample import SamplingSpec
from tests.fakes.fake_sglang import FakeSGLang, Faults
from tests.unit.test_rollout_fake import CODEC, PROMPT, greedy_reference

pytestmark = pytest.mark.reliability
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROBE = 1.0  # the probe's limit in these tests (weight_sync.probe_timeout_s)


@pytest.fixture
def stoppable():
    """A fake server in a process (and process group) of its own: ``(url, pgid)``; SIGSTOP it to hang it."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.fakes.fake_sglang", "--tick-s", "0.01"], cwd=REPO,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://"), f"the fake server did not start: {url!r}"
        yield url, proc.pid
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _verdict(url: str, timeout: float = PROBE) -> tuple[str | None, float]:
    async def go():
        c = EngineClient(url)
        t0 = time.monotonic()
        try:
            return await liveness(c, timeout, retry_s=0.2), time.monotonic() - t0
        finally:
            await c.close()

    return asyncio.run(go())


def test_liveness_verdict(stoppable, reliability):
    from mrl.sglang.endpoint import free_port

    url, pgid = stoppable
    assert _verdict(url)[0] is None
    os.killpg(pgid, signal.SIGSTOP)
    why, seconds = _verdict(url)
    assert why is not None and f"{url}/model_info: timed out after {PROBE}s (no answer)" in why, why
    assert seconds < PROBE + 1.0
    reliability.record(category="timeout", name="liveness probe of a SIGSTOPped engine", survived=True,
                       injected="fake SGLang server in its own process, SIGSTOPped (its port still accepts)",
                       expected="judged dead within the probe's limit (weight_sync.probe_timeout_s)",
                       message=why.replace(url, "http://<engine>"), details={"seconds": round(seconds, 2)})

    refused = f"http://127.0.0.1:{free_port()}"
    assert "connection failed" in _verdict(refused)[0]
    with FakeSGLang(faults=Faults(unavailable_endpoints=("*",))) as srv:
        why, _ = _verdict(srv.url)
        assert why is not None and "failed 3 times" in why and "HTTP 503" in why, why
    with FakeSGLang(faults=Faults(hang_endpoints=("*",))) as srv:
        assert "no answer" in _verdict(srv.url)[0]
    with FakeSGLang(faults=Faults(hang_endpoints=("/pause_generation", "/health"))) as srv:
        assert _verdict(srv.url)[0] is None  # only some calls hang: the server is up

    async def paused(u):  # /health would block while paused; the probe must not
        c = EngineClient(u)
        await c.pause("abort")
        try:
            return await liveness(c, PROBE)
        finally:
            await c.resume()
            await c.close()

    with FakeSGLang() as srv:
        assert asyncio.run(paused(srv.url)) is None


def test_control_call_to_a_stopped_engine_ends_with_engine_hung(stoppable):
    url, pgid = stoppable
    os.killpg(pgid, signal.SIGSTOP)

    async def go():
        c = EngineClient(url)
        t0 = time.monotonic()
        try:
            with pytest.raises(EngineHung) as e:
                await watched(c, c.pause("abort"), "/pause_generation", probe_timeout_s=PROBE)
            return str(e.value), time.monotonic() - t0
        finally:
            await c.close()

    msg, seconds = asyncio.run(go())
    assert msg.startswith(f"{url}/pause_generation: no answer after 1 s and liveness probe failed"), msg
    assert seconds < 1.0 + PROBE + 1.0  # not the pause's own 60 s


def _manager(urls: list[str], **kw) -> RolloutManager:
    return RolloutManager([EngineClient(u) for u in urls], sampling=SamplingSpec(max_new_tokens=120), codec=CODEC,
                          probe_timeout_s=PROBE, **kw)


def _check_samples(mgr, samples, n):
    assert len(samples) == n and mgr.stats.completed == n and mgr.stats.failed == 0, mgr.stats
    for s in samples:
        assert s.error is None and s.response_ids == greedy_reference(s.prompt_ids, 120)
        s.check()


def test_engine_stopped_mid_rollout_is_bypassed_and_no_sample_is_lost(stoppable, reliability):
    """The stopped engine's requests would wait out /generate's one-hour limit; it is probed once they have
    gone ``probe_timeout_s`` unanswered, judged hung, and its samples finish on the other engine."""
    url, pgid = stoppable

    async def go(good):
        mgr = _manager([url, good])
        groups = [asyncio.create_task(mgr.generate_group(PROMPT + [g], n=4, group_id=g)) for g in range(4)]
        await asyncio.sleep(0.3)
        assert mgr.slots[0].inflight > 0  # 120 tokens take the stoppable server 1.2 s
        os.killpg(pgid, signal.SIGSTOP)
        t0 = time.monotonic()
        done = await asyncio.wait_for(asyncio.gather(*groups), 30)
        seconds = time.monotonic() - t0
        await close_clients([s.client for s in mgr.slots])
        return mgr, [s for g in done for s in g], seconds

    with FakeSGLang() as good:
        mgr, samples, seconds = asyncio.run(go(good.url))
    _check_samples(mgr, samples, 16)
    assert not mgr.slots[0].healthy and "judged hung" in mgr.slots[0].why and mgr.slots[1].healthy
    assert mgr.stats.retries >= 1 and seconds < 2 * PROBE + 5
    reliability.record(
        category="fault", name="1 of 2 engines SIGSTOPped during rollouts", survived=True,
        injected="fake SGLang server in its own process SIGSTOPped with requests in flight; 16 samples in 4 groups",
        expected="probed after weight_sync.probe_timeout_s without an answer, judged hung, its requests "
                 "abandoned and retried on the other engine, none lost",
        message=mgr.slots[0].why.replace(url, "http://<engine>"),
        samples={"generated": mgr.stats.submitted, "trained": None, "dropped": 0, "failed": mgr.stats.failed,
                 "retried": mgr.stats.retries, "lost": mgr.stats.submitted - mgr.stats.completed - mgr.stats.failed},
        details={"seconds_from_stop_to_all_samples_done": round(seconds, 2)})


def test_drain_does_not_wait_on_a_stopped_engine(stoppable):
    """Before a sync the drain aborts every request; the stopped engine answers no abort: it is probed at
    once, judged hung, and its requests come back (to resume elsewhere after ``undrain``)."""
    url, pgid = stoppable

    async def go(good):
        mgr = _manager([url, good])
        groups = [asyncio.create_task(mgr.generate_group(PROMPT + [g], n=4, group_id=g)) for g in range(2)]
        await asyncio.sleep(0.3)
        os.killpg(pgid, signal.SIGSTOP)
        t0 = time.monotonic()
        await mgr.drain(timeout=30)
        seconds = time.monotonic() - t0
        left = sum(s.inflight for s in mgr.slots)
        mgr.undrain()
        done = await asyncio.wait_for(asyncio.gather(*groups), 30)
        await close_clients([s.client for s in mgr.slots])
        return mgr, [s for g in done for s in g], seconds, left

    with FakeSGLang() as good:
        mgr, samples, seconds, left = asyncio.run(go(good.url))
    assert left == 0 and seconds < 1.0 + PROBE + 2, seconds
    # judged by the drain's abort or by the rollout side's own probe, whichever came first
    assert not mgr.slots[0].healthy and "liveness probe failed" in mgr.slots[0].why
    _check_samples(mgr, samples, 8)


# -- the weight sync's verdict ---------------------------------------------------------------------------
@pytest.fixture
def world(tmp_path):
    """A one-rank gloo world (the sync's verdict is a broadcast)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _sync(urls: list[str]):
    from mrl.weight_sync.full import FullWeightChannel
    from mrl.sglang.endpoint import EngineEndpoint
    from mrl.weight_sync.transport import PushStats, Transport

    seen = {"forgot": [], "rebuilt": [], "pushed": 0}

    class Recorder(Transport):
        name = "recorder"

        def push(self, version, engines=None):
            seen["pushed"] += 1
            return PushStats(seconds=0.0, bytes_sent=0, buckets_sent=0)

        def forget(self, urls):
            seen["forgot"] += urls

    def rebuild(engines):
        seen["rebuilt"].append([e.url for e in engines])
        t = Recorder()
        return t, t

    t = Recorder()
    return FullWeightChannel(t, t, SimpleNamespace(world_rank=0), [EngineEndpoint(u) for u in urls], rebuild=rebuild,
                      probe_timeout_s=PROBE), seen


@pytest.mark.parametrize("fault", ["sigstop", "503 everywhere"])
def test_sync_drops_a_hung_engine_and_syncs_the_others(world, stoppable, fault, reliability):
    url, pgid = stoppable
    with FakeSGLang() as good, FakeSGLang(faults=Faults(unavailable_endpoints=("*",))) as failing:
        bad = url if fault == "sigstop" else failing.url
        if fault == "sigstop":
            os.killpg(pgid, signal.SIGSTOP)
        sync, seen = _sync([bad, good.url])
        t0 = time.monotonic()
        rep = sync.sync("1")
        seconds = time.monotonic() - t0
        assert good.st.weight_version == "1" and good.st.paused is None  # stamped and resumed
    assert rep.dropped_engines == [bad] and [e.url for e in sync.engines] == [good.url]
    assert seen == {"forgot": [bad], "rebuilt": [[good.url]], "pushed": 1}
    why = rep.dead_reasons[bad]
    if fault == "sigstop":
        assert "/pause_generation: no answer after 1 s and liveness probe failed" in why and "timed out" in why
        assert seconds < 1.0 + PROBE + 3  # not the pause's own 60 s
    else:
        assert "failed 3 times" in why and "HTTP 503" in why
    reliability.record(
        category="fault", name=f"engine {'SIGSTOPped' if fault == 'sigstop' else 'answering 503 to everything'} "
                               "at a weight sync", survived=True,
        injected="1 of 2 fake SGLang servers " + ("SIGSTOPped (in its own process)" if fault == "sigstop" else
                                                  "answers 503 on every endpoint") + " when the sync pauses them",
        expected="judged dead by the liveness probe, dropped (no teardown sent to it), the other synced",
        message=why.replace(bad, "http://<engine>"), details={"sync_seconds": round(seconds, 2)})


def test_sync_still_fails_naming_an_engine_that_is_up_but_cannot_pause(world):
    with FakeSGLang() as good, FakeSGLang(faults=Faults(unavailable_endpoints=("/pause_generation",))) as odd:
        sync, seen = _sync([odd.url, good.url])
        with pytest.raises(RuntimeError, match="could not pause engines") as e:
            sync.sync("1")
    assert odd.url in str(e.value) and "HTTP 503" in str(e.value) and good.url not in str(e.value)
    assert seen["forgot"] == [] and sync.dropped == []


# -- killing what is dead ----------------------------------------------------------------------------------
def _stopped_group():
    """An Engine whose process group (a shell and its child) is SIGSTOPped."""
    from mrl.engine.launcher import Engine

    eng = Engine(model_path="unused", name="stopped")
    eng.proc = subprocess.Popen(["sh", "-c", "sleep 600 & sleep 600"], start_new_session=True)
    deadline = time.monotonic() + 10
    while len(eng.pids()) < 2:
        assert time.monotonic() < deadline, "the group did not start"
        time.sleep(0.05)
    os.killpg(eng.proc.pid, signal.SIGSTOP)
    return eng


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_stopped_engine_is_ended_at_once(how):
    """SIGTERM waits on a stopped process until it is continued: ``stop`` sends SIGCONT after it, ``kill``
    sends SIGKILL (which a stopped process cannot hold up)."""
    eng = _stopped_group()
    pids = eng.pids()
    t0 = time.monotonic()
    getattr(eng, how)()
    assert time.monotonic() - t0 < 5 and eng.pids() == [] and eng.proc.returncode is not None
    assert not [p for p in pids if _running(p)], pids


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_restarter_kills_the_dead_engine_before_its_replacement_starts(monkeypatch):
    from mrl.engine.launcher import Engine
    from mrl.engine.restart import EngineRestarter

    seen = {}

    def start(self):  # the replacement: no SGLang here, only what was left of the old one when it started
        seen["old_pids_at_start"] = seen["old"].pids()
        return self

    monkeypatch.setattr(Engine, "start", start)
    monkeypatch.setattr(Engine, "wait_healthy", lambda self, timeout=0: self)
    old = _stopped_group()
    assert EngineRestarter([old], max_restarts=0).replace([old.url]) == []
    assert old.pids() == []  # no restarts left: killed all the same
    seen["old"] = old = _stopped_group()
    new = EngineRestarter([old], max_restarts=1).replace([old.url])
    assert len(new) == 1 and new[0].name == "stopped-r1" and seen["old_pids_at_start"] == []


def test_the_verify_probe_of_a_hung_engine_ends_at_its_limit():
    """``weight_sync.verify`` asks each engine for a one-token probe with ``weight_sync.timeout_s`` as its
    limit (``run_on(..., timeouts=...)``): an engine that accepts the request and never answers is reported
    unreachable after that limit, not after the client's hour-long generation limit."""
    from mrl.sglang.client import ClientTimeouts
    from mrl.sglang.endpoint import EngineEndpoint
    from mrl.weight_sync.transport import run_on

    async def probe(c):
        await c.generate([1, 2, 3], {"max_new_tokens": 1, "temperature": 0.0}, rid="verify-probe",
                         logprob_start_len=0)

    with FakeSGLang(faults=Faults(hang=True)) as hung, FakeSGLang() as ok:
        t = time.monotonic()
        errs = run_on([EngineEndpoint(hung.url), EngineEndpoint(ok.url)], probe,
                      timeouts=ClientTimeouts(control=2.0, generate=2.0))
        took = time.monotonic() - t
    assert list(errs) == [hung.url] and took < 10, (errs, took)
