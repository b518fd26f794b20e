"""``mrl train`` with an engine SIGKILLed inside a weight sync: the fault the e2e tests inject.

    python -m tests.jobs.train_with_faults --kill-engine-during-sync 5:1 train [overrides...]

``<version>[:<engine>[:<broadcast>]]`` kills engine number ``engine`` (of those alive at that sync; default:
the last) during the weight sync to ``version``, right before trainer rank 0's broadcast number
``broadcast`` (default 0) of the push: the engines are paused and flushed, the buckets before it are on
them, every update request is posted. Only engines on this host (found by the port they listen on).

The launcher role runs ``mrl train`` with this module as the trainer ranks' entry point (its torchrun call
rewritten); each rank then wraps the distributed transport's push with the kill and runs the loop
(``mrl.jobs.train``). Nothing in ``mrl`` knows of it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from urllib.parse import urlparse

SPEC_ENV = "MRL_TEST_KILL_ENGINE_DURING_SYNC"  # launcher -> trainer ranks (torchrun passes the environment on)
MODULE = "tests.jobs.train_with_faults"


@contextlib.contextmanager
def kill_during_sync(spec: str, version: str, engines: list, controller: bool):
    want, _, rest = spec.partition(":")
    if not controller or want != version:
        yield
        return
    import torch.distributed as dist

    idx, _, nth = rest.partition(":")
    victim, at = engines[int(idx) if idx else -1].url, int(nth or 0)
    real, seen = dist.broadcast, [0]

    def broadcast(*args, **kwargs):  # the push's broadcasts, counted on the rank that injects the fault
        if seen[0] == at:
            print(f"[mrl] fault injection (kill engine during sync {spec}): SIGKILL engine {victim} "
                  f"before broadcast {at} of weight sync v{version}", flush=True)
            kill_engine(victim)
        seen[0] += 1
        return real(*args, **kwargs)

    dist.broadcast = broadcast  # patched for this one push, restored below
    try:
        yield
    finally:
        dist.broadcast = real
    if seen[0] <= at:
        raise RuntimeError(f"kill engine during sync {spec}: the push of v{version} made only {seen[0]} "
                           "broadcasts on this rank, so no engine was killed")


def kill_engine(url: str) -> None:
    """SIGKILL the process group of the server listening on ``url``'s port and wait until the port refuses
    connections."""
    import psutil

    u = urlparse(url)
    pids = {c.pid for c in psutil.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == u.port and c.pid}
    if not pids:
        raise RuntimeError(f"no process listens on {url}")
    for pid in pids:
        pgid = os.getpgid(pid)
        if pgid != os.getpgid(0):  # servers run in process groups of their own; never take the job down
            os.killpg(pgid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            socket.create_connection((u.hostname, u.port), timeout=1).close()
        except OSError:
            return
        time.sleep(0.05)
    raise RuntimeError(f"{url} still accepts connections 30 s after SIGKILL")


def launch(argv: list[str]) -> None:
    """``--kill-engine-during-sync SPEC train [overrides...]``: ``mrl train`` with this module on the ranks."""
    from mrl import cli, process

    if argv[:1] != ["--kill-engine-during-sync"] or argv[2:3] != ["train"]:
        sys.exit(f"usage: python -m {MODULE} --kill-engine-during-sync SPEC train [overrides...]")
    os.environ[SPEC_ENV] = argv[1]
    real = process.torchrun

    def torchrun(module, *args, **kwargs):  # cli.train looks torchrun up in mrl.process at each call
        return real(MODULE if module == process.TRAIN_MODULE else module, *args, **kwargs)

    process.torchrun = torchrun
    sys.argv = ["mrl", *argv[2:]]
    cli.main()


def rank_main(config_path: str) -> int:
    """The loop, with the kill around the first push of each weight version (the sync's own push; a second
    one, after the sync dropped the dead engine, and the disk repair run as they are)."""
    from mrl.jobs.train import main
    from mrl.weight_sync.distributed import DistributedTransport

    spec, real, pushed = os.environ[SPEC_ENV], DistributedTransport.push, set()

    def push(self, version, engines=None):
        if version in pushed:
            return real(self, version, engines)
        pushed.add(version)
        controller = self.executor.layout.world_rank == 0
        with kill_during_sync(spec, version, self.executor.engines, controller):
            return real(self, version, engines)

    DistributedTransport.push = push
    return main(config_path)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--kill-engine-during-sync"]:
        launch(sys.argv[1:])
    else:
        sys.exit(rank_main(sys.argv[1]))
