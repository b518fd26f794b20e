"""SIGTERM to a real ``mrl train`` (one SGLang CPU engine, one trainer rank, the rollout process) ends every
process of the job within 30 s: the ranks, the engines and the rollout process run in sessions of their own,
so the launcher must end them itself."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from tests.e2e.test_faults import QUICK, _start, _steps, _wait_for

pytestmark = pytest.mark.reliability


def test_sigterm_to_mrl_train_ends_every_process_of_the_job(tmp_path, reliability):
    run = tmp_path / "run"
    proc = _start(run, *QUICK, "train.steps=200", "rollout.num_engines=1")
    try:
        _wait_for(proc, lambda: len(_steps(run)) >= 1, "step 1 (engines up, rollout running)")
        first = _steps(run)[0]  # and the loop's weight_sync.verify after its sync (on for fp32 engines)
        assert 0 <= first["sync_verify_max_diff"] <= 1e-3 and first["sync_verify_unreachable"] == 0, first
        tree = psutil.Process(proc.pid).children(recursive=True)
        cmds = [" ".join(p.cmdline()) for p in tree]
        assert any("sglang.launch_server" in c for c in cmds), cmds
        assert any("mrl.rollout.service" in c for c in cmds) and any("mrl.jobs.train" in c for c in cmds), cmds
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        gone, alive = psutil.wait_procs(tree, timeout=max(0.1, 30 - (time.monotonic() - t0)))
        took = time.monotonic() - t0
        left = [f"{p.pid}: {' '.join(p.cmdline())[:120]}" for p in alive if p.is_running()]
        for p in alive:
            p.kill()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not left, left
    assert proc.returncode == 128 + signal.SIGTERM
    err = open(os.path.join(run, "stderr.txt")).read()
    assert "[mrl] stopped by SIGTERM: every process of the job was ended" in err, err[-2000:]
    reliability.record(category="fault", name="SIGTERM to mrl train", survived=True,
                       injected="SIGTERM to `mrl train` once step 1 is logged (1 engine, 1 rank, rollout process)",
                       expected="every process of the job ends within 30 s",
                       message=f"{len(tree)} processes (rank, rollout process, SGLang engine and its children) "
                               f"ended in {took:.1f} s; exit {proc.returncode}")
