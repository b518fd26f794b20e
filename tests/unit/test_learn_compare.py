"""bench/learn_compare.py: runs side by side from their metrics.jsonl (the GPU learning runs' report)."""

import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")
sys.path.insert(0, BENCH)
from learn_compare import summarize  # noqa: E402


def _write_run(path, rewards, evals, sync):
    os.makedirs(path)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        for i, (r, s) in enumerate(zip(rewards, sync), start=1):
            f.write(json.dumps({"step": i, "reward": r, "sync_seconds": s, "step_seconds": 1.0 + i,
                                "kl_engine_replay_on": 1e-4 * i}) + "\n")
            if i in evals:
                f.write(json.dumps({"step": i, "eval/accuracy": evals[i]}) + "\n")
        f.write(json.dumps({"step": len(rewards), "lr": 1e-6}) + "\n")  # a scalar row without a step's figures


def test_summary_first_and_last_steps_and_medians_without_the_first_step(tmp_path):
    rewards = [0.1 * i for i in range(20)]
    _write_run(tmp_path / "a", rewards, {1: 0.5, 20: 0.9}, [9.0] + [0.2] * 19)
    s = summarize([json.loads(x) for x in open(tmp_path / "a" / "metrics.jsonl")])
    assert s["steps"] == 20
    assert s["reward_first"] == 0.0 and s["reward_final"] == pytest.approx(1.9)
    assert s["reward_first10_mean"] == pytest.approx(0.45) and s["reward_last10_mean"] == pytest.approx(1.45)
    assert s["eval_accuracy_first"] == 0.5 and s["eval_accuracy_final"] == 0.9
    assert s["sync_seconds"]["median"] == pytest.approx(0.2) and s["sync_seconds"]["n"] == 19  # 9 s step 1 left out
    assert s["step_seconds"]["median"] == pytest.approx(12.0)  # steps 2..20: 3..21 s
    assert s["mismatch/numerics_kl"] is None  # a figure the runs did not log


def test_command_writes_report_and_png_and_names_a_bad_run(tmp_path):
    _write_run(tmp_path / "bf16", [0.2, 0.4, 0.6], {3: 0.7}, [0.1, 0.1, 0.1])
    _write_run(tmp_path / "fp8", [0.2, 0.3, 0.5], {3: 0.6}, [0.1, 0.05, 0.05])
    out = tmp_path / "r.json"
    cmd = [sys.executable, os.path.join(BENCH, "learn_compare.py"), "--run", f"bf16={tmp_path / 'bf16'}",
           "--run", f"fp8={tmp_path / 'fp8'}", "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    rep = json.loads(out.read_text())
    assert rep["runs"] == ["bf16", "fp8"] and rep["summary"]["fp8"]["reward_final"] == 0.5
    assert (tmp_path / "r.png").stat().st_size > 10_000
    bad = subprocess.run(cmd[:2] + ["--run", f"x={tmp_path / 'missing'}", "--out", str(out)], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode != 0 and "no metrics.jsonl" in bad.stderr
