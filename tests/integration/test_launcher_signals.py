"""Signals to the launcher (``mrl.process.torchrun``, what ``mrl train`` runs): SIGTERM, SIGHUP and SIGINT end
every process under it within seconds, though the ranks and what they start (as engines do) run in sessions of
their own; SIGUSR1 reaches the ranks. Stand-in ranks here (a sleeping job); ``tests/e2e/test_faults.py`` (the end of
the engine-restart run) sends SIGTERM to a real ``mrl train``; the Slurm tests USR1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.reliability

_LAUNCHER = """
import sys
from mrl.process import Terminated, torchrun
try:
    sys.exit(torchrun("tests.integration.test_launcher_signals", [sys.argv[1]], 2, capture=False).returncode)
except Terminated as e:
    print(f"launcher: {e}", flush=True)
    sys.exit(128 + e.signum)
"""


def _default_sigint() -> None:
    # A suite started as a background job of a non-interactive shell (`make test &`) inherits SIGINT
    # ignored, and Python then installs no KeyboardInterrupt handler: the launcher would rightly ignore the
    # SIGINT this test sends. A user's launcher in a terminal has the default disposition; so does this one.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(tmp_path) -> tuple[subprocess.Popen, list[psutil.Process]]:
    proc = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            preexec_fn=_default_sigint)
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("ready.*"))) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.2)
    tree = psutil.Process(proc.pid).children(recursive=True)
    return proc, tree


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=lambda s: s.name)
def test_signal_to_the_launcher_ends_every_process_under_it(sig, tmp_path, reliability):
    proc, tree = _start(tmp_path)
    assert len(tree) >= 5  # agent, 2 ranks, 2 "engines" in sessions of their own
    assert len({p.pid for p in tree if os.getsid(p.pid) != os.getsid(proc.pid)}) >= 4
    t0 = time.monotonic()
    proc.send_signal(sig)
    proc.wait(timeout=30)
    gone, alive = psutil.wait_procs(tree, timeout=max(0.1, 30 - (time.monotonic() - t0)))
    took = time.monotonic() - t0
    for p in alive:
        p.kill()
    assert not alive, [p.pid for p in alive]
    assert proc.returncode == 128 + sig or (sig == signal.SIGINT and proc.returncode != 0)
    reliability.record(category="fault", name=f"{sig.name} to the launcher (stand-in ranks)", survived=True,
                       injected=f"{sig.name} to the torchrun launcher of 2 ranks, each with a child in its own session",
                       expected="every process under the launcher ends within 30 s",
                       message=f"{len(tree)} processes ended in {took:.1f} s")


def test_sigusr1_to_the_launcher_reaches_the_ranks(tmp_path):
    proc, tree = _start(tmp_path)
    proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 30
    while len(list(tmp_path.glob("usr1.*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sorted(p.name for p in tmp_path.glob("usr1.*")) == ["usr1.0", "usr1.1"]
    assert proc.wait(timeout=30) == 0  # the ranks exit 0 on SIGUSR1, as the trainer's do after its checkpoint
    assert not psutil.wait_procs(tree, timeout=15)[1]


def _rank(out_dir: str) -> None:
    rank = os.environ["RANK"]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    got = []
    signal.signal(signal.SIGUSR1, lambda *_: got.append(1))
    open(os.path.join(out_dir, f"ready.{rank}"), "w").write(str(child.pid))
    while not got:
        time.sleep(0.1)
    open(os.path.join(out_dir, f"usr1.{rank}"), "w").write("")
    child.kill()


if __name__ == "__main__":
    _rank(sys.argv[1])
