"""A stopped engine's server dies before it reaps its children. The process that started it is their
subreaper (``become_subreaper``) and reaps them itself (``reap_zombies``), only those of the engine's
session: a ``Popen`` of its own keeps its exit status."""

from __future__ import annotations

import subprocess
import time

import psutil

from mrl.process import become_subreaper, reap_zombies


def _zombie(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"{pid} did not exit"
        time.sleep(0.02)


def test_orphans_of_a_session_are_reaped_and_a_popen_keeps_its_status():
    become_subreaper()
    # a session leader that leaves a child behind, as a killed server leaves its scheduler
    leader = subprocess.Popen(["bash", "-c", "sleep 0.2 & echo $!; exit 0"], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    orphan = int(leader.stdout.readline())
    assert leader.wait(timeout=10) == 0
    own = subprocess.Popen(["bash", "-c", "exit 3"], start_new_session=True)  # another session, not waited yet
    assert psutil.Process(orphan).ppid() == psutil.Process().pid  # handed to this process, not to PID 1
    _zombie(orphan)
    _zombie(own.pid)

    assert reap_zombies(session=leader.pid) == [orphan]
    assert not psutil.pid_exists(orphan)
    assert psutil.Process(own.pid).status() == psutil.STATUS_ZOMBIE  # not another session's
    assert own.wait(timeout=10) == 3
