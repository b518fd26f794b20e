"""Hangs: every engine HTTP call and every loop collective ends within its limit, naming the operation and the peer.

- HTTP (fault-injecting fake server, each endpoint in turn accepts the request and never answers): every
  ``EngineClient`` call and the executor's pipelined bucket updates raise ``EngineUnavailable`` with the
  engine URL, the endpoint and the limit, within the limit;
- collectives (2 gloo ranks under torchrun, a 3 s group timeout, one rank never joins or dies): the loop's
  batch broadcast, a barrier, and the weight-update group rendezvous raise ``CollectiveError`` naming the
  collective, the group, its ranks and the rank waited for.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import pytest

from mrl.sglang.client import ClientTimeouts, EngineClient
from mrl.sglang.protocol import EngineUnavailable
from tests.conftest import run_torchrun
from tests.jobs.outcome import record_outcome
from tests.fakes.fake_sglang import FakeSGLang, Faults

pytestmark = pytest.mark.reliability
LIMIT = 0.5
CALLS = {  # endpoint -> the client call that hits it
    "/generate": lambda c: c.generate([1, 2, 3], {"max_new_tokens": 2}, rid="t"),
    "/abort_request": lambda c: c.abort("t"),
    "/pause_generation": lambda c: c.pause("abort"),
    "/continue_generation": lambda c: c.resume(),
    "/flush_cache": lambda c: c.flush_cache(),
    "/init_weights_update_group": lambda c: c.init_weights_update_group(
        master_address="127.0.0.1", master_port=1, rank_offset=1, world_size=2, group_name="g", backend="gloo"),
    "/update_weights_from_distributed": lambda c: c.update_weights_from_distributed(
        names=["a"], dtypes=["float32"], shapes=[[1]], group_name="g"),
    "/destroy_weights_update_group": lambda c: c.destroy_weights_update_group("g"),
    "/update_weights_from_disk": lambda c: c.update_weights_from_disk("/nonexistent"),
    "/update_weight_version": lambda c: c.update_weight_version("1"),
    "/model_info": lambda c: c.model_info(),
    "/server_info": lambda c: c.server_info(),
    "/v1/loads": lambda c: c.loads(),
}


@pytest.mark.parametrize("endpoint", sorted(CALLS))
def test_every_engine_call_times_out_naming_engine_and_endpoint(endpoint, reliability):
    async def go(url):
        c = EngineClient(url, timeouts=ClientTimeouts(connect=LIMIT, control=LIMIT, generate=LIMIT,
                                                      weight_update=LIMIT))
        if endpoint != "/init_weights_update_group":
            c.groups.add("g")  # as if this client had created the group (the guard allows the update)
        t0 = time.monotonic()
        with pytest.raises(EngineUnavailable) as e:
            await CALLS[endpoint](c)
        await c.close()
        return time.monotonic() - t0, str(e.value)

    with FakeSGLang(faults=Faults(hang_endpoints=(endpoint,))) as srv:
        seconds, msg = asyncio.run(go(srv.url))
    assert msg == f"{srv.url}{endpoint}: timed out after {LIMIT}s (no answer)"
    assert seconds < LIMIT + 1.0
    reliability.record(category="timeout", name=f"engine {endpoint} never answers", survived=True,
                       injected=f"{endpoint} accepts the request and never answers",
                       expected=f"EngineUnavailable after the client's limit ({LIMIT} s here)",
                       message=msg.replace(srv.url, "http://<engine>"), details={"seconds": round(seconds, 2)})


def test_health_probe_of_a_hung_engine_returns_false_within_its_limit():
    async def go(url):
        c = EngineClient(url)
        t0 = time.monotonic()
        ok = await c.health(timeout=LIMIT)
        await c.close()
        return ok, time.monotonic() - t0

    with FakeSGLang(faults=Faults(hang_endpoints=("/health",))) as srv:
        ok, seconds = asyncio.run(go(srv.url))
    assert ok is False and seconds < LIMIT + 1.0


def test_pipelined_bucket_updates_time_out_naming_engine_and_endpoint(reliability):
    """The executor's weight-update requests (one connection, pipelined): each unanswered one is an error
    naming the engine and the endpoint; the rest are reported as not answered."""
    from mrl.sglang.pipeline import post_pipelined

    ep = "/update_weights_from_distributed"
    with FakeSGLang(faults=Faults(hang_endpoints=(ep,))) as srv:
        t0 = time.monotonic()
        answers = asyncio.run(post_pipelined(srv.url, ep, [b"{}", b"{}"], timeout=LIMIT))
        seconds = time.monotonic() - t0
    assert [type(a) for a in answers] == [EngineUnavailable, EngineUnavailable]
    assert str(answers[0]) == f"{srv.url}{ep}: timed out after {LIMIT}s" and "not answered" in str(answers[1])
    assert seconds < LIMIT + 1.0
    reliability.record(category="timeout", name="weight-update bucket request never answered", survived=True,
                       injected=f"{ep} (pipelined, 2 buckets) accepts and never answers",
                       expected="each bucket request fails after weight_sync.timeout_s, naming engine and endpoint",
                       message=str(answers[0]).replace(srv.url, "http://<engine>"),
                       details={"seconds": round(seconds, 2)})


def test_dead_engine_is_a_connection_error_naming_it():
    from mrl.sglang.endpoint import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nobody listens

    async def go():
        c = EngineClient(url)
        with pytest.raises(EngineUnavailable, match=f"{url}/model_info: connection failed"):
            await c.model_info()
        await c.close()

    asyncio.run(go())


def test_weight_update_group_rendezvous_nobody_joins(reliability):
    """``FullWeightChannel.connect`` when the engines never join the sender's rendezvous (the store waits for them)."""
    from types import SimpleNamespace

    from mrl.megatron.collectives import CollectiveError
    from mrl.sglang.endpoint import free_port
    from mrl.weight_sync.full import FullWeightChannel
    from mrl.weight_sync.group import create_sender_group
    from mrl.sglang.endpoint import EngineEndpoint
    from mrl.weight_sync.transport import Transport

    class Rendezvous(Transport):
        name = "rendezvous"

        def connect(self) -> None:
            create_sender_group(master_address="127.0.0.1", master_port=free_port(), world_size=2,
                                group_name="mrl-t-g0", backend="gloo", timeout_s=1.0)

        def push(self, version, engines=None):
            raise AssertionError("not reached")

    engines = [EngineEndpoint("http://127.0.0.1:1")]
    sync = FullWeightChannel(Rendezvous(), None, SimpleNamespace(world_rank=0), engines)
    t0 = time.monotonic()
    with pytest.raises(CollectiveError) as e:
        sync.connect()
    msg = str(e.value)
    assert "creating the weight-update groups with engines ['http://127.0.0.1:1']" in msg
    assert "1/2 clients joined" in msg and time.monotonic() - t0 < 5
    reliability.record(category="timeout", name="engines never join the weight-update group", survived=True,
                       injected="the trainer hosts the group's rendezvous; no engine rank joins",
                       expected="error after weight_sync.timeout_s naming the engines", message=msg)


# -- collectives: 2 gloo ranks -----------------------------------------------------------------------
CASES = {
    "batch broadcast, rank 0 never sends": ("batch", 1, "broadcast of the step-1 batch over the world group "
                                            "(ranks [0, 1]) timed out after", "waiting for rank 0"),
    "barrier, rank 1 never joins": ("barrier", 0, "the barrier closing weight sync v3 over the world group "
                                    "(ranks [0, 1]) timed out after", "waiting for ranks [1]"),
    "batch broadcast, rank 0 dies": ("dead", 1, "broadcast of the step-1 batch over the world group (ranks [0, 1]) "
                                     "failed after", "(a peer died?)"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_collective_hang_names_op_group_and_peer(case, tmp_path, reliability):
    kind, rank, want, peer = CASES[case]
    r = run_torchrun("tests.unit.test_timeouts", [kind, str(tmp_path)], 2, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads((tmp_path / f"rank{rank}.json").read_text())
    assert want in got["message"] and peer in got["message"], got
    assert got["type"] == "CollectiveError" and got["seconds"] < 3 + 2.0
    if kind != "dead":
        assert "(the group's limit: 3 s)" in got["message"] and got["seconds"] >= 2.9
    reliability.record(category="timeout", name=f"collective: {case}", survived=True,
                       injected=f"2 gloo ranks, 3 s group timeout: {case}",
                       expected="CollectiveError naming the collective, the group and the peer, within the limit",
                       message=got["message"], details={"seconds": round(got["seconds"], 2)})


def _worker(kind: str, out: str) -> None:
    """One rank of ``test_collective_hang_names_op_group_and_peer`` (torchrun, 2 ranks)."""
    from datetime import timedelta

    import torch.distributed as dist

    from mrl.megatron.collectives import broadcast_object, named

    dist.init_process_group("gloo", timeout=timedelta(seconds=3))
    me = dist.get_rank()
    absent = 0 if kind in ("batch", "dead") else 1
    if me == absent:
        if kind != "dead":
            time.sleep(6)  # never joins within the limit
        os._exit(0)  # "dead": gone at once, its sockets closed
    def call():
        if kind == "barrier":
            with named("the barrier closing weight sync v3"):
                dist.barrier()
        else:
            broadcast_object(None, what="the step-1 batch")

    record_outcome(out, me, call)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])


# -- a rank that dies: the launcher's summary line ---------------------------------------------------
def test_launcher_summary_names_dead_rank_signal_and_checkpoint(tmp_path):
    from types import SimpleNamespace

    from mrl.process import failure_summary, resume_hint

    killed = SimpleNamespace(exitcode=-9, pid=42, timestamp=2.0, signal_name=lambda: "SIGKILL")
    raised = SimpleNamespace(exitcode=1, pid=41, timestamp=1.0, signal_name=lambda: "")
    assert failure_summary("mrl.train", {1: killed}, world_size=2) == \
        "mrl.train failed: rank 1 (pid 42) was killed by SIGKILL; torchrun stopped the other ranks."
    assert failure_summary("mrl.train", {1: killed, 0: raised}, world_size=2) == (
        "mrl.train failed: rank 0 (pid 41) exited with code 1 (its error is above); "
        "rank 1 (pid 42) was killed by SIGKILL.")  # first failure first; nobody left to stop
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"run_dir: {tmp_path}\ntrain:\n  resume: true\n")
    assert "No checkpoint in" in resume_hint("mrl.jobs.train", [str(cfg)])
    for step in (2, 10, 4):
        (tmp_path / "checkpoints" / f"step_{step}").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_10" / "loop_state.json").touch()  # complete
    (tmp_path / "checkpoints" / "step_2" / "loop_state.json").touch()  # step_4: written half-way, ignored
    assert resume_hint("mrl.jobs.train", [str(cfg)]).strip() == (
        f"Last checkpoint: {tmp_path}/checkpoints/step_10 -- rerun the same command to resume from it.")
    assert resume_hint("mrl.jobs.check_model", [str(cfg)]) == ""
