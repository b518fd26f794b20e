"""The CPU image, run for real: its build check and `mrl check` inside, and `mrl train` inside learning, with the
engine and the trainer rank in the container and the run directory on a mounted host folder.

No network inside (``--network none``): the tiny model is generated and every process talks over the
container's loopback. The training run costs a few minutes on the 2-core box.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.container.podman import run

pytestmark = pytest.mark.container

TRAIN_STEPS = 100
TRAIN = ["mrl", "train", "run_dir=/runs/train", "model.hf_path=/runs/models/tiny", f"train.steps={TRAIN_STEPS}",
         "train.eval_every=0"]
"""The README's default run (GRPO on copy_last, one CPU engine, one Megatron rank), shortened."""


def test_build_check_and_preflight_inside(image, tmp_path):
    p = run(image, ["python", "docker/verify_image.py", "--cpu"], timeout=300)
    assert p.returncode == 0 and "image ok (cpu)" in p.stdout, p.stdout + p.stderr
    p = run(image, ["sh", "-c", "id -un; pwd; command -v mrl; command -v python"], timeout=60)
    assert p.stdout.split() == ["root", "/opt/mrl", "/usr/local/bin/mrl", "/usr/local/bin/python"], p.stdout
    # the preflight inside the image, on a run directory of the host
    p = run(image, ["mrl", "check", "run_dir=/runs/r"], volumes={str(tmp_path): "/runs"}, timeout=300)
    assert p.returncode == 0 and "preflight passed: run_dir=/runs/r" in p.stdout + p.stderr, p.stdout + p.stderr
    p = run(image, ["mrl", "check", "model.hf_path=/runs/none", "model.make_tiny_if_missing=false"],
            volumes={str(tmp_path): "/runs"}, timeout=300)
    assert p.returncode == 2 and "model.hf_path=/runs/none: no such directory" in p.stderr, p.stdout + p.stderr


def test_train_learns_inside_the_image(image, tmp_path):
    p = run(image, TRAIN, volumes={str(tmp_path): "/runs"}, env={"OMP_NUM_THREADS": "1"}, timeout=1500)
    assert p.returncode == 0, (p.stdout + p.stderr)[-5000:]
    out = tmp_path / "train"
    for name in ("config.yaml", "metrics.jsonl", "summary.json", f"checkpoints/step_{TRAIN_STEPS}/loop_state.json"):
        assert (out / name).exists(), f"{name} missing on the host volume: {sorted(os.listdir(out))}"
    assert any(f.endswith(".log") for f in os.listdir(out / "engines")), "no engine log: was the engine inside?"
    rows = [json.loads(x) for x in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows if "step_seconds" in r] == list(range(1, TRAIN_STEPS + 1))
    rewards = [r["reward"] for r in rows if "reward" in r]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"\n[container] reward first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert first < 0.3 and last > first + 0.2, rewards
