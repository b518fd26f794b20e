"""AdmissionGate: calls waiting for a full engine go in together (a quantum of free slots, or the oldest's
wait), never more than the limit in flight, a first wave and an idle engine without delay, cancellation
without leaked slots."""

import asyncio

import pytest

from mrl.rollout.admission import AdmissionGate


class _Engine:
    """Calls through a gate, recording the in-flight count and when each call got in."""

    def __init__(self, gate: AdmissionGate):
        self.gate, self.inflight, self.peak, self.entered = gate, 0, 0, []
        self.release: dict[int, asyncio.Event] = {}

    async def call(self, i: int, hold: float | None = None):
        async with self.gate:
            self.inflight += 1
            self.peak = max(self.peak, self.inflight)
            self.entered.append((i, asyncio.get_running_loop().time()))
            ev = self.release.setdefault(i, asyncio.Event())
            if hold is not None:
                await asyncio.sleep(hold)
            else:
                await ev.wait()
            self.inflight -= 1


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_waiting_calls_go_in_together_once_a_quantum_of_slots_is_free():
    async def main():
        gate = AdmissionGate(8, quantum=4, max_wait_s=60)
        eng = _Engine(gate)
        tasks = [asyncio.create_task(eng.call(i)) for i in range(20)]
        await asyncio.sleep(0.01)
        assert sorted(i for i, _ in eng.entered) == list(range(8))  # the first wave at once
        for i in range(3):  # three finish: not yet a quantum
            eng.release.setdefault(i, asyncio.Event()).set()
        await asyncio.sleep(0.01)
        assert len(eng.entered) == 8 and gate.in_use == 5
        before = gate.admissions
        eng.release.setdefault(3, asyncio.Event()).set()  # the fourth: four go in, oldest first
        await asyncio.sleep(0.01)
        assert [i for i, _ in eng.entered[8:]] == [8, 9, 10, 11]
        assert gate.admissions == before + 1  # let in together: one burst at the engine
        for i in range(20):
            eng.release.setdefault(i, asyncio.Event()).set()
        await asyncio.gather(*tasks)
        assert eng.peak == 8 and gate.in_use == 0 and len(eng.entered) == 20

    _run(main())


def test_the_oldest_waiters_wait_is_bounded():
    """Fewer finish than the quantum: the waiting calls go in after max_wait_s, not never."""
    async def main():
        gate = AdmissionGate(4, quantum=4, max_wait_s=0.2)
        eng = _Engine(gate)
        loop = asyncio.get_running_loop()
        tasks = [asyncio.create_task(eng.call(i)) for i in range(6)]
        await asyncio.sleep(0.01)
        t0 = loop.time()
        eng.release.setdefault(0, asyncio.Event()).set()
        await asyncio.sleep(0.1)
        assert len(eng.entered) == 4  # one slot free, quantum 4, waited 0.1 s < 0.2 s
        await asyncio.sleep(0.25)
        assert [i for i, _ in eng.entered[4:]] == [4]
        assert eng.entered[4][1] - t0 >= 0.15
        for i in range(6):
            eng.release.setdefault(i, asyncio.Event()).set()
        await asyncio.gather(*tasks)
        assert eng.peak == 4 and gate.in_use == 0

    _run(main())


def test_quantum_one_is_a_semaphore():
    async def main():
        gate = AdmissionGate(2, quantum=1)
        eng = _Engine(gate)
        tasks = [asyncio.create_task(eng.call(i)) for i in range(4)]
        await asyncio.sleep(0.01)
        eng.release.setdefault(0, asyncio.Event()).set()
        await asyncio.sleep(0.01)
        assert [i for i, _ in eng.entered] == [0, 1, 2]
        for i in range(4):
            eng.release.setdefault(i, asyncio.Event()).set()
        await asyncio.gather(*tasks)
        assert eng.peak == 2

    _run(main())


def test_an_idle_engine_and_a_short_backlog_take_calls_at_once():
    """Slots left free after an admission keep the gate open; an engine that emptied takes calls at once."""
    async def main():
        gate = AdmissionGate(8, quantum=4, max_wait_s=60)
        eng = _Engine(gate)
        first = [asyncio.create_task(eng.call(i)) for i in range(8)]
        await asyncio.sleep(0.01)
        waiting = [asyncio.create_task(eng.call(i)) for i in (8, 9)]
        await asyncio.sleep(0.01)
        for i in range(4):
            eng.release[i].set()
        await asyncio.sleep(0.01)
        assert [i for i, _ in eng.entered[8:]] == [8, 9] and gate.in_use == 6  # two slots still free: open
        late = asyncio.create_task(eng.call(10))
        await asyncio.sleep(0.01)
        assert eng.entered[-1][0] == 10  # at once
        for i in range(11):
            eng.release.setdefault(i, asyncio.Event()).set()
        await asyncio.gather(*first, *waiting, late)
        assert gate.in_use == 0
        await eng.call(11, hold=0)  # idle: at once, no wait for a quantum
        assert eng.entered[-1][0] == 11

    _run(main())


def test_cancelled_waiters_leak_no_slot_and_do_not_block_the_queue():
    async def main():
        gate = AdmissionGate(2, quantum=2, max_wait_s=60)
        eng = _Engine(gate)
        running = [asyncio.create_task(eng.call(i)) for i in range(2)]
        await asyncio.sleep(0.01)
        doomed = asyncio.create_task(eng.call(2))
        kept = [asyncio.create_task(eng.call(i)) for i in (3, 4)]
        await asyncio.sleep(0.01)
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        eng.release[0].set()
        eng.release[1].set()
        await asyncio.sleep(0.01)
        assert [i for i, _ in eng.entered[2:]] == [3, 4] and gate.in_use == 2
        # let in, then cancelled before running: its slot comes back
        eng.release[3].set()
        eng.release[4].set()
        await asyncio.gather(*running, *kept)
        assert gate.in_use == 0

    _run(main())


def test_a_call_cancelled_after_it_was_let_in_gives_its_slot_back():
    async def main():
        gate = AdmissionGate(1, quantum=1)
        async with gate:
            w = asyncio.create_task(gate.__aenter__())
            await asyncio.sleep(0.01)
        # leaving the block let w in (its future resolved), and w is cancelled before it resumes
        assert gate.in_use == 1
        w.cancel()
        with pytest.raises(asyncio.CancelledError):
            await w
        assert gate.in_use == 0
        async with gate:
            assert gate.in_use == 1

    _run(main())


@pytest.mark.parametrize("kw, what", [({"limit": 0}, "limit"), ({"limit": 4, "quantum": 5}, "quantum"),
                                      ({"limit": 4, "max_wait_s": -1}, "max_wait_s")])
def test_bad_settings_are_refused(kw, what):
    with pytest.raises(ValueError, match=what):
        AdmissionGate(**kw)


@pytest.mark.parametrize("admit_batch", [1, 4])
def test_the_rollout_manager_admits_queued_samples_in_bursts(admit_batch):
    """Through mrl's RolloutManager against an engine (the fake server): 40 samples of unequal lengths at 8
    in flight all complete; with admit_batch 4 the 32 queued ones go in as a few bursts, not one by one."""
    from mrl.rollout.manager import RolloutManager
    from mrl.rollout.client import EngineClient
    from mrl.rollout.sample import SamplingSpec
    from tests.fakes.fake_sglang import FakeSGLang

    async def main(url):
        client = EngineClient(url)
        mgr = RolloutManager([client], sampling=SamplingSpec(max_new_tokens=8, ignore_eos=True),
                             max_inflight_per_engine=8, admit_batch=admit_batch, admit_wait_s=5.0)
        lengths = [[3 + (7 * g + 3 * i) % 11 for i in range(4)] for g in range(10)]
        groups = await asyncio.gather(*(mgr.generate_group([5, 6, 7], n=4, group_id=g, max_new_tokens=b)
                                        for g, b in enumerate(lengths)))
        await client.close()
        assert [[len(s.response_ids) for s in grp] for grp in groups] == lengths
        assert mgr.stats.completed == 40 and mgr.stats.failed == 0
        return mgr.slots[0].sem.admissions

    with FakeSGLang() as srv:
        admissions = _run(main(srv.url))
    if admit_batch == 1:
        assert admissions == 32  # each queued sample as its slot freed
    else:
        assert admissions <= 32 // 4 + 1  # in bursts of at least 4 (the last one may be the wait's)
