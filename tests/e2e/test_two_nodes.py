"""Two nodes on one box: the engines run in a network namespace of their own (``mrl engine``, its own address
on a veth pair), the trainer (``mrl train``) on the host. They meet only over that link, as a trainer node and
an engine node of a cluster do: the trainer finds the engines' announcements, samples from them, and every
step pushes its weights through weight-update groups whose stores it hosts. An engine dials the address of
the trainer's interface that routes to it; loopback would be its own. One of the two engines is SIGKILLed on
its node mid-run: it is dropped at the next sync and the other serves to the end.

Needs root (``ip netns``); skipped, saying so, where network namespaces cannot be made."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess

import pytest

from tests.e2e.test_faults import (MRL, QUICK, REPO, _engine_pgid, _finish, _nothing_lost, _start, _steps,
                                   _assert_engines_hold_trainer_weights, _wait_for)

pytestmark = pytest.mark.reliability


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {p.stderr.strip()}")


@pytest.fixture
def engine_node():
    """(namespace, its address, the host's address on the link): a veth pair, one end in a new namespace whose
    host name resolves to its own address there (``ip netns exec`` reads ``/etc/netns/<ns>/hosts``)."""
    tag = os.getpid() % 250
    ns, host_if, node_if = f"mrl-node{tag}", f"mrlh{tag}", f"mrln{tag}"
    host_ip, node_ip = f"10.213.{tag}.1", f"10.213.{tag}.2"
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2): network namespaces unavailable")
    try:
        _ip("netns", "add", ns)
    except RuntimeError as e:
        pytest.skip(f"cannot create a network namespace here (needs root): {e}")
    etc = f"/etc/netns/{ns}"
    try:
        _ip("link", "add", host_if, "type", "veth", "peer", "name", node_if)
        _ip("link", "set", node_if, "netns", ns)
        _ip("addr", "add", f"{host_ip}/24", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("addr", "add", f"{node_ip}/24", "dev", node_if, ns=ns)
        _ip("link", "set", node_if, "up", ns=ns)
        _ip("link", "set", "lo", "up", ns=ns)
        _ip("route", "add", "default", "via", host_ip, ns=ns)
        os.makedirs(etc, exist_ok=True)
        with open(f"{etc}/hosts", "w") as f:
            f.write(f"127.0.0.1 localhost\n{node_ip} {socket.gethostname()}\n")
        yield ns, node_ip, host_if, node_if
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, timeout=30)
        shutil.rmtree(etc, ignore_errors=True)


def test_trainer_and_engines_on_two_nodes_train_sync_and_survive_a_killed_engine(tmp_path, engine_node, reliability):
    ns, node_ip, host_if, node_if = engine_node
    run, urls = tmp_path / "run", tmp_path / "run" / "engines_announced"
    os.makedirs(run, mode=0o700)
    common = [f"run_dir={run}", f"rollout.engine_url_dir={urls}", "rollout.num_engines=2"]
    # each side's gloo on its end of the link, as on a cluster whose nodes have several interfaces
    node = subprocess.Popen(["ip", "netns", "exec", ns, MRL, "engine", *common], cwd=REPO, start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=node_if),
                            stdout=open(tmp_path / "node.txt", "w"), stderr=subprocess.STDOUT)
    try:
        _wait_for(node, lambda: len(os.listdir(urls)) >= 2 if urls.exists() else False,
                  "both engines announced by the engine node", timeout=600)
        announced = sorted(open(urls / f).read().strip() for f in os.listdir(urls))
        assert all(u.startswith(f"http://{node_ip}:") for u in announced), announced
        # the trainer takes the node's announcements because the node is one of the job's hosts
        proc = _start(run, *common[1:], "train.steps=5", "train.max_staleness=0",
                      "reward.fn=tests.e2e.reward_fns.response_length", *QUICK,
                      env={"GLOO_SOCKET_IFNAME": host_if, "SLURM_JOB_NODELIST": node_ip})
        _wait_for(proc, lambda: any(r["step"] >= 2 for r in _steps(run)), "step 2")
        os.killpg(_engine_pgid(run, f"{socket.gethostname()}-engine1"), signal.SIGKILL)  # on the other node
        rc, out, err = _finish(proc, run)
        assert rc == 0, err[-5000:]
    finally:
        node.send_signal(signal.SIGTERM)
        try:
            node.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(node.pid, signal.SIGKILL)
    steps = _steps(run)
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    alive = [int(r["engines_alive"]) for r in steps]
    assert alive[:2] == [2, 2] and alive[-1] == 1 and steps[-1]["engines_dropped"] == 1, alive
    # every step synced across the link into the engines the trainer sampled from: their logprobs equal the
    # trainer's (max_staleness=0), and weight_sync.verify agreed after every sync
    _assert_engines_hold_trainer_weights(steps)
    assert all(r["sync_seconds"] > 0 and r["sync_verify_max_diff"] <= 1e-3 for r in steps), steps
    samples = _nothing_lost(steps)
    reliability.record(
        category="fault", name="engine SIGKILLed on another node", survived=True, samples=samples,
        injected="two nodes on one box (engines in a network namespace, trainer on the host); SIGKILL to 1 of "
                 "the 2 engines on the engine node once step 2 is logged",
        expected="weights synced across the nodes every step; the dead engine dropped at the next sync; run "
                 "completes on the other",
        message=f"engines_alive {alive}; engine logprobs == trainer's at every step "
                f"(max {max(r['logprob_diff_replay_on'] for r in steps):.1e})",
        details={"sync_seconds_median": round(sorted(r["sync_seconds"] for r in steps)[2], 3)})
