"""The queue an asynchronous checkpoint save's forked writer reports through (``compat.checkpoint_writes_in_child``):
its server process is forked, not spawned, and dies with the rank that made it, even when the rank is killed."""

import os
import signal
import subprocess
import sys
import time

import psutil

RANK = """
import os, sys
from mrl.megatron import compat
from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
compat.checkpoint_writes_in_child()
q = fa._results_queue
q.put("ok")
print(q._manager._process.pid, q.get(), flush=True)
compat.checkpoint_writes_in_child()  # idempotent: the same queue
assert fa._results_queue is q
compat.checkpoint_writes_in_process()  # a synchronous save in the same process keeps it too
assert fa._results_queue is q
sys.stdin.read()  # wait to be killed
"""


def test_the_writer_queue_server_dies_with_its_rank():
    rank = subprocess.Popen([sys.executable, "-c", RANK], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        pid, got = rank.stdout.readline().split()
        assert got == "ok"
        server = psutil.Process(int(pid))
        assert server.ppid() == rank.pid  # forked by the rank, not a spawned interpreter elsewhere
        os.kill(rank.pid, signal.SIGKILL)  # no finalizer runs
        rank.wait(timeout=30)
        deadline = time.monotonic() + 10
        while server.is_running() and server.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not server.is_running() or server.status() == psutil.STATUS_ZOMBIE
    finally:
        if rank.poll() is None:
            rank.kill()
