"""In-flight weight updates with real SGLang CPU engines (``weight_sync.pause_mode``, ``mrl.engine.server.inflight``).

Greedy samples are running in the TP1 engine when ``FullWeightChannel`` pushes other weights (tiny, seed 1)
in retract or in-place mode. Each sample then holds tokens of both versions, tagged exactly, from one request
(never aborted), and the engine's logprobs and routes are those of the weights that produced each token,
checked against transformers on the same checkpoints:

- retract: the KV cache is recomputed, so the tokens after the swap, and every route row, equal a fresh
  prefill of the whole sequence with the new weights;
- in_place: the KV cache of the older weights is kept, so the tokens after the swap equal the new weights
  run on top of the old weights' KV cache (and differ from a fresh prefill), the rows before the swap a
  prefill with the old weights.

The transports with requests held in the engine: the distributed one (megatron, gloo) and the disk one push while
a request is paused mid-generation. An engine killed during an in-place update: nothing is lost.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from mrl.engine.launcher import Engine
from mrl.models import get_bridge
from mrl.models.tiny import make_tiny_model
from mrl.rollout.manager import RolloutManager
from mrl.rollout.sample import Sample, SamplingSpec
from mrl.routing.codec import RoutesCodec
from mrl.sglang.client import EngineClient
from mrl.weight_sync.full import FullWeightChannel
from mrl.weight_sync.transport import PushStats, Transport, run_on
from tests.conftest import one_rank_gloo_world, run_torchrun

PROMPTS = [[1, 17, 42, 99, 7], [1, 300, 5, 9, 11, 250, 3]]
N = 48
BEFORE_SWAP = 6
"""Tokens each sample has at least when the sync starts."""


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def new_weights(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("seed1") / "tiny"), seed=1)


@pytest.fixture(scope="module")
def codec(ckpt_dir):
    return RoutesCodec.from_bridge(get_bridge(ckpt_dir["tiny"]))


@pytest.fixture(scope="module")
def hf(ckpt_dir, new_weights):
    from transformers import AutoModelForCausalLM

    return {name: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            for name, path in (("old", ckpt_dir["tiny"]), ("new", new_weights))}


@pytest.fixture(scope="module")
def world():
    """A one-rank gloo world: the channel's verdicts and closing barrier are collectives."""
    with one_rank_gloo_world():
        dist.init_process_group("gloo", rank=0, world_size=1)
        yield SimpleNamespace(world_rank=0)


def _restore(urls, path):
    async def go():
        for url in urls:
            c = EngineClient(url)
            await c.pause("abort")
            await c.flush_cache()  # retried until the aborted requests are gone: the load's own flush asserts
            await c.update_weights_from_disk(path, weight_version="0")
            await c.resume()  # the engine tags tokens with version 0 again
            await c.close()

    run(go())


@pytest.fixture
def tp1(engines, ckpt_dir):
    """The TP1 engine on its own weights (seed 0, version 0) before and after the test."""
    _restore([engines["tp1"].url], ckpt_dir["tiny"])
    yield engines["tp1"]
    _restore([engines["tp1"].url], ckpt_dir["tiny"])


class CheckpointPush(Transport):
    """``update_weights_from_disk`` of a checkpoint already on disk: the disk transport without its export (the
    trainer side of every transport is tested in test_weight_sync.py). ``before`` runs first (a fault)."""

    name = "disk"

    def __init__(self, path, engines, before=None):
        self.path, self.engines, self.before = path, list(engines), before

    def push(self, version, engines=None):
        if self.before is not None:
            self.before()
        failed = run_on(engines or self.engines, lambda c: c.update_weights_from_disk(
            self.path, weight_version=version, flush_cache=False))
        return PushStats(seconds=0.0, bytes_sent=0, buckets_sent=1, failed_engines=failed)


async def _running(clients, tokens: int, timeout: float = 300.0) -> None:
    """Until the engines hold ``tokens`` KV tokens of running requests in all (prompts + generated so far)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        used = 0
        for c in clients:
            data = await c.loads()
            used += sum(x.get("num_used_tokens", 0) for x in data.get("loads", []))
        if used >= tokens:
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"the engines never held {tokens} tokens")


def _samples(n=N):
    return [Sample(prompt_ids=list(p), group_id=i, index=0, max_new_tokens=n) for i, p in enumerate(PROMPTS)]


def _topk(router_logits, k: int) -> np.ndarray:
    """[rows, layers, k] expert ids from transformers' per-layer router logits."""
    return torch.stack([torch.topk(x, k, dim=-1).indices for x in router_logits], 1).numpy()


@torch.no_grad()
def _reference(hf, s: Sample, k: int, mode: str):
    """(response logprobs, route rows) of ``s`` as the engine computed them with the swap after response token
    ``k``: positions < P + k - 1 ran on the old weights; in_place keeps their KV cache, retract recomputes it."""
    seq = torch.tensor([s.tokens])
    p, top_k = len(s.prompt_ids), s.routes.shape[2]

    def logprobs(logits, at):  # of the tokens after positions at, at + 1, ...
        lp = torch.log_softmax(logits[0], -1)
        nxt = seq[0, at + 1: at + 1 + lp.shape[0]]
        return lp[torch.arange(len(nxt)), nxt].numpy()

    old = hf["old"](input_ids=seq[:, :-1], output_router_logits=True)
    if mode == "retract":
        new = hf["new"](input_ids=seq[:, :-1], output_router_logits=True)
        lps = np.concatenate([logprobs(old.logits, 0)[p - 1:p - 1 + k], logprobs(new.logits, 0)[p - 1 + k:]])
        return lps, _topk(new.router_logits, top_k)
    cut = p + k - 1
    head = hf["old"](input_ids=seq[:, :cut], use_cache=True, output_router_logits=True)
    tail = hf["new"](input_ids=seq[:, cut:-1], past_key_values=head.past_key_values, output_router_logits=True)
    lps = np.concatenate([logprobs(old.logits, 0)[p - 1:cut], logprobs(tail.logits, cut)])
    return lps, np.concatenate([_topk(head.router_logits, top_k), _topk(tail.router_logits, top_k)])


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_tokens_after_the_swap_come_from_the_new_weights(tp1, hf, new_weights, codec, world, mode):
    channel = FullWeightChannel(CheckpointPush(new_weights, [tp1.endpoint]), None, world, [tp1.endpoint],
                                pause_mode=mode)

    async def go():
        client = EngineClient(tp1.url)
        mgr = RolloutManager([client], sampling=SamplingSpec(max_new_tokens=N, temperature=0.0, ignore_eos=True),
                             codec=codec, inflight_updates=True)
        tasks = [asyncio.create_task(mgr.run_sample(s)) for s in _samples()]
        await _running([client], sum(map(len, PROMPTS)) + len(PROMPTS) * BEFORE_SWAP)
        rep = await asyncio.to_thread(channel.sync, "1")
        samples = await asyncio.gather(*tasks)
        await client.close()
        return rep, samples

    rep, samples = run(go())
    channel.close()
    assert rep.phase_seconds["pause"] < 5 and not rep.dropped_engines
    for s in samples:
        assert s.error is None and len(s.response_ids) == N
        assert s.num_segments == 1 and s.num_aborts == 0  # one request, never aborted or resubmitted
        k = s.versions.index(1)
        assert BEFORE_SWAP <= k < N and s.versions == [0] * k + [1] * (N - k), s.versions
        lps, routes = _reference(hf, s, k, mode)
        assert np.abs(np.asarray(s.response_logprobs) - lps).max() <= 1e-3
        assert routes.shape == s.routes.shape
        assert np.array_equal(np.sort(routes, -1), np.sort(s.routes.astype(np.int64), -1))
        if mode == "in_place":  # the kept KV cache shows: a fresh prefill with the new weights scores them otherwise
            fresh, _ = _reference(hf, s, k, "retract")
            assert np.abs(np.asarray(s.response_logprobs[k:]) - fresh[k:]).max() > 1e-2


class StagedPush(Transport):
    """A staged ``update_weights_from_disk`` of a checkpoint on disk, then, before the push returns (and the channel
    commits), a wait until the engines have decoded ``progress`` more tokens: a push that lasts while the engine
    generates, by the engine's own count, never by a sleep. Records the engine's KV tokens of running requests at
    the push's start and when the load was answered."""

    name = "disk"

    def __init__(self, path, engines, clients, progress: int):
        self.path, self.engines, self.clients, self.progress = path, list(engines), clients, progress
        self.used: dict[str, int] = {}
        self.answers: dict[str, str] = {}

    def push(self, version, engines=None):
        async def used(wait_for: int = 0):
            if wait_for:
                await _running(self.clients, wait_for, timeout=120)
            n = 0
            for c in self.clients:
                n += sum(x.get("num_used_tokens", 0) for x in (await c.loads()).get("loads", []))
                await c.close()
            return n

        self.used["start"] = run(used())
        async def load(c):
            self.answers[c.url] = await c.update_weights_from_disk(
                self.path, weight_version=version, flush_cache=False, load_format=self.load_format(None))

        failed = run_on(engines or self.engines, load)
        self.used["loaded"] = run(used())
        self.used["returned"] = run(used(self.used["loaded"] + self.progress))
        return PushStats(seconds=0.0, bytes_sent=0, buckets_sent=1, failed_engines=failed)


STAGED_N = 96
"""Tokens per sample in the staged test: enough that the samples outlast the load and the wait after it."""
STAGED_PROGRESS = 8
"""Tokens the engine decodes after the staged load before the push returns."""


def test_staged_update_swaps_in_between_two_forward_passes(tp1, hf, new_weights, codec, world):
    """``pause_mode=staged``: the samples keep decoding while the engine loads the new weights into its staged copy
    (the push waits for more tokens before it returns), then the weights are swapped in between two forward passes
    at ``/continue_generation``. Tokens before the swap are the old weights', those after it the new weights' on the
    kept KV cache (the in-place reference), tagged exactly, and no request is aborted or paused."""
    client = EngineClient(tp1.url)
    transport = StagedPush(new_weights, [tp1.endpoint], [EngineClient(tp1.url)], STAGED_PROGRESS)
    channel = FullWeightChannel(transport, None, world, [tp1.endpoint], pause_mode="staged")
    assert transport.staged

    async def go():
        mgr = RolloutManager([client], sampling=SamplingSpec(max_new_tokens=STAGED_N, temperature=0.0,
                                                             ignore_eos=True), codec=codec, inflight_updates=True)
        tasks = [asyncio.create_task(mgr.run_sample(s)) for s in _samples(STAGED_N)]
        await _running([client], sum(map(len, PROMPTS)) + len(PROMPTS) * BEFORE_SWAP)
        rep = await asyncio.to_thread(channel.sync, "1")
        samples = await asyncio.gather(*tasks)
        await client.close()
        return rep, samples

    t0 = time.perf_counter()
    rep, samples = run(go())
    channel.close()
    assert not rep.dropped_engines and not rep.failed_engines
    at_swap = 0
    for s in samples:
        assert s.error is None and len(s.response_ids) == STAGED_N
        assert s.num_segments == 1 and s.num_aborts == 0  # one request, never aborted or resubmitted
        k = s.versions.index(1)
        assert BEFORE_SWAP <= k < STAGED_N and s.versions == [0] * k + [1] * (STAGED_N - k), s.versions
        lps, routes = _reference(hf, s, k, "in_place")
        assert np.abs(np.asarray(s.response_logprobs) - lps).max() <= 1e-3
        assert np.array_equal(np.sort(routes, -1), np.sort(s.routes.astype(np.int64), -1))
        at_swap += len(s.prompt_ids) + k
    # the engine's KV tokens of running requests when the push began, and the tokens before the swap: the samples
    # decoded through the push (a paused engine would have added none and the push would have timed out waiting)
    during = at_swap - transport.used["start"]
    print(f"staged: {during} tokens decoded between the push's start and the swap "
          f"({transport.used['loaded'] - transport.used['start']} during the load itself); {transport.answers}; "
          f"{time.perf_counter() - t0:.1f} s")
    assert during >= STAGED_PROGRESS, (at_swap, transport.used)


def test_distributed_and_disk_transports_push_while_a_request_is_held(tp1, new_weights, ckpt_dir, tmp_path):
    """A request held by an in-place pause mid-generation; the sync job (megatron, gloo) pushes the new weights
    over the distributed transport in in-place mode; held again, the old ones go back over the disk transport in
    retract mode. The engine keeps the request throughout (no flush, which SGLang's scheduler would assert on),
    its probe equals megatron's after each push, and the request ends with tokens of all three versions, in
    order (the request is long enough to outlast both jobs' teardown, then aborted: its partial reply is kept)."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def on_loop(coro, timeout=300):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    client = EngineClient(tp1.url)
    rid = f"held-{time.time()}"
    task = on_loop(_start_held(client, rid))
    try:
        for i, (hf_dir, transport, mode) in enumerate(((new_weights, "distributed", "in_place"),
                                                        (ckpt_dir["tiny"], "disk", "retract"))):
            on_loop(client.pause("in_place"))  # held until the job continues it
            out = tmp_path / f"sync{i}.json"
            r = run_torchrun("mrl.jobs.sync_weights", ["--hf", hf_dir, "--engines", f"{tp1.url}@1", "--version",
                                                       str(i + 1), "--out", str(out), "--transport", transport,
                                                       "--repair-dir", str(tmp_path / "export"), "--pause-mode", mode,
                                                       "--no-probe-before"], 1)
            assert r.returncode == 0, r.stderr[-4000:]
            rep = json.loads(out.read_text())
            assert rep["pause_mode"] == mode and rep["engine_versions"] == [str(i + 1)]
            assert max(rep["probe_max_abs_logprob_diff"]) <= 1e-3 and not rep["failed_engines"], rep
            assert not task.done(), "the request ended before the sync"
        on_loop(client.abort(rid), 60)
        out = on_loop(asyncio.wait_for(task, 120), 180)
    finally:
        on_loop(client.close(), 30)
        loop.call_soon_threadsafe(loop.stop)
    v = out.token_versions
    assert out.finish.type == "abort" and 0 < len(v) < HELD_TOKENS and v == sorted(v) and set(v) == {0, 1, 2}, v


HELD_TOKENS = 2000
"""Nearly the tiny model's context: far more decode than the time between a job continuing the request and
exiting, so the request is still running when each job has ended."""


async def _start_held(client, rid):
    """A long greedy request, running once it has a few tokens (a future of its reply)."""
    task = asyncio.ensure_future(client.generate(PROMPTS[0], {"max_new_tokens": HELD_TOKENS, "temperature": 0.0,
                                                              "ignore_eos": True}, rid=rid))
    await _running([client], len(PROMPTS[0]) + BEFORE_SWAP)
    return task


KILLED_N = 160
"""Tokens per sample in the kill test: enough that the samples on the survivor are still running when the sync
pauses it (with a few dozen, they could finish between the wait for running requests and the pause)."""


@pytest.fixture
def doomed(ckpt_dir, tmp_path):
    """A second TP1 engine, killed by the test."""
    e = Engine(model_path=ckpt_dir["tiny"], tp=1, log_dir=str(tmp_path), name="doomed")
    e.start()
    try:
        e.wait_healthy(timeout=600)
        yield e
    finally:
        e.stop()


def test_an_engine_killed_during_an_in_place_update_loses_nothing(tp1, doomed, new_weights, codec, world):
    """Both engines are paused in place with samples running; the doomed one is SIGKILLed before the push.
    The sync drops it and updates the other; its samples resume on the survivor (retried from their last
    answer), every sample completes, each token tagged with the version that produced it."""
    urls = [tp1.url, doomed.url]
    endpoints = [tp1.endpoint, doomed.endpoint]

    def kill():
        os.killpg(os.getpgid(doomed.proc.pid), signal.SIGKILL)
        doomed.proc.wait(60)

    channel = FullWeightChannel(CheckpointPush(new_weights, endpoints, before=kill), None, world, endpoints,
                                pause_mode="in_place", rebuild=lambda es: (CheckpointPush(new_weights, es), None))

    async def go():
        clients = [EngineClient(u) for u in urls]
        mgr = RolloutManager(clients, sampling=SamplingSpec(max_new_tokens=KILLED_N, temperature=0.0, ignore_eos=True),
                             codec=codec, inflight_updates=True)
        samples = [Sample(prompt_ids=list(p), group_id=g, index=i, max_new_tokens=KILLED_N)
                   for g, p in enumerate(PROMPTS) for i in range(2)]
        tasks = [asyncio.create_task(mgr.run_sample(s)) for s in samples]
        await _running(clients, 2 * sum(map(len, PROMPTS)) + len(samples) * 2)
        rep = await asyncio.to_thread(channel.sync, "1")
        done = await asyncio.gather(*tasks)
        for c in clients:
            await c.close()
        return rep, done, mgr

    rep, samples, mgr = run(go())
    channel.close()
    assert rep.dropped_engines == [doomed.url]
    assert [s.healthy for s in mgr.slots] == [True, False]
    moved = [s for s in samples if s.num_retries]
    assert moved, "no sample was running on the killed engine"
    for s in samples:
        assert s.error is None and len(s.response_ids) == KILLED_N and s.versions == sorted(s.versions)
        assert s.routes.shape[0] == len(s.tokens) - 1
    for s in moved:  # started over on the survivor after the sync: every token from the new weights
        assert s.versions == [1] * KILLED_N
    assert any(0 in s.versions and 1 in s.versions for s in samples), "no sample ran across the swap"
