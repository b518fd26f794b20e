"""A child that dies with its parent (``PR_SET_PDEATHSIG``) dies when the *thread* that started it ends:
started from a short-lived helper thread (an engine restarted on a fresh port by its health watcher) it
would be killed at once. ``on_lasting_thread`` starts it from a thread that lasts as long as the process."""

from __future__ import annotations

import subprocess
import threading
import time

from mrl.process import die_with_parent, on_lasting_thread


def _start_from_helper_thread(lasting: bool) -> subprocess.Popen:
    box = []

    def spawn():
        start = lambda: subprocess.Popen(["sleep", "60"], preexec_fn=die_with_parent)  # noqa: E731
        box.append(on_lasting_thread(start) if lasting else start())

    t = threading.Thread(target=spawn)
    t.start()
    t.join()  # the helper thread is gone
    return box[0]


def test_a_child_started_from_a_helper_thread_outlives_it_on_the_lasting_thread():
    plain, lasting = _start_from_helper_thread(False), _start_from_helper_thread(True)
    try:
        deadline = time.monotonic() + 10
        while plain.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert plain.returncode == -9  # the control: SIGKILLed when its thread ended
        time.sleep(0.5)
        assert lasting.poll() is None  # alive: its parent thread lasts
    finally:
        for p in (plain, lasting):
            p.kill()
            p.wait()
