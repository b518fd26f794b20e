"""`mrl train` end to end: real SGLang engine (CPU mode), Megatron trainer, the RL loop.

The default overlap run, which must learn: the sampled reward rises clearly over the run. The other
runs (tests/e2e/test_algorithms.py) check the loop's mechanics, several per run: each `mrl train` run
costs minutes on the 2-core box.
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


def test_default_run_learns(tmp_path):
    """The README's default run, shortened: the sampled reward must rise clearly."""
    _, rows = mrl_train(tmp_path / "default", "train.steps=70", "train.eval_every=0")
    rewards = [r["reward"] for r in rows if "reward" in r]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"\n[mrl train] reward first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert first < 0.3 and last > first + 0.2, rewards  # README run: 0.03 -> 0.5 by step 70
