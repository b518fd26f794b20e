"""`mrl train` end to end: real SGLang engine (CPU mode), Megatron trainer, the RL loop.

One sync-mode run (staleness 0 by construction, versions advance every step, outputs written) and
the default overlap run, which must learn: the sampled reward rises clearly over the run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MRL = os.path.join(os.path.dirname(sys.executable), "mrl")


def mrl_train(run_dir, *overrides, timeout=1500):
    p = subprocess.run([MRL, "train", f"run_dir={run_dir}", *overrides], capture_output=True, text=True,
                       timeout=timeout, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr[-5000:]
    rows = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
    return p, rows


def test_sync_mode_run_writes_everything(tmp_path):
    run = tmp_path / "sync"
    _, rows = mrl_train(run, "train.mode=sync", "train.steps=3", "train.sft_warmup_steps=2",
                        "train.prompts_per_step=4", "train.eval_every=2", "train.save_every=2")
    steps = [r for r in rows if "step_seconds" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["version"] for r in steps] == [2, 3, 4]  # v1 = after the warm start; +1 per step
    assert all(set(r["staleness_hist"]) == {"0"} for r in steps)  # sync mode: never stale
    assert all(r["sync_seconds"] > 0 and r["sync_repaired"] == 0 for r in steps)
    assert all(0.0 <= r["reward"] <= 1.0 and r["routing_disagreement"] < 0.05 for r in steps)
    assert any("eval/accuracy" in r for r in rows) and any("sft/nll" in r for r in rows)
    for name in ("config.yaml", "curves.png", "summary.json", "checkpoints/step_2/loop_state.pkl",
                 "checkpoints/step_3/loop_state.pkl"):
        assert (run / name).exists(), name
    assert os.listdir(run / "tb")


def test_default_run_learns(tmp_path):
    """The README's default run, shortened: the sampled reward must rise clearly."""
    _, rows = mrl_train(tmp_path / "default", "train.steps=70", "train.eval_every=0")
    rewards = [r["reward"] for r in rows if "reward" in r]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"\n[mrl train] reward first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert first < 0.3 and last > first + 0.2, rewards  # README run: 0.03 -> 0.5 by step 70


def _engine_pgid(run_dir, name: str) -> int:
    """Process group of the SGLang server behind ``<run_dir>/engines/<name>.log`` (found by its port)."""
    import re

    import psutil

    log = open(os.path.join(run_dir, "engines", f"{name}.log")).read()
    port = re.search(r"port=(\d+)", log).group(1)
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if "sglang.launch_server" in " ".join(cmd) and port in cmd:
            return os.getpgid(p.info["pid"])
    raise AssertionError(f"no server process for {name} (port {port})")


def test_engine_killed_mid_run_is_survived(tmp_path):
    """Two engines; one is SIGKILLed after step 2. Its requests go to the survivor, the next weight sync
    drops it and rebuilds the groups, the run finishes every step, and no sample is lost."""
    import signal
    import time

    run = tmp_path / "kill"
    proc = subprocess.Popen([MRL, "train", f"run_dir={run}", "rollout.num_engines=2", "train.steps=6",
                             "train.sft_warmup_steps=0", "train.eval_every=0", "train.prompts_per_step=4"],
                            cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 600
        while time.time() < deadline:
            rows = [json.loads(x) for x in open(run / "metrics.jsonl")] if (run / "metrics.jsonl").exists() else []
            if any(r.get("step", 0) >= 2 and "step_seconds" in r for r in rows):
                break
            assert proc.poll() is None, proc.stderr.read()[-4000:]
            time.sleep(1)
        os.killpg(_engine_pgid(run, "engine1"), signal.SIGKILL)
        _, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-5000:]
    steps = [json.loads(x) for x in open(run / "metrics.jsonl")]
    steps = [r for r in steps if "step_seconds" in r]
    assert [r["step"] for r in steps] == list(range(1, 7))
    last = steps[-1]
    assert last["engines_alive"] == 1 and last["engines_dropped"] == 1
    assert last["rollout/samples_failed"] == 0 and last.get("rollout/groups_failed", 0) == 0  # nothing lost
