"""`mrl train` end to end: real SGLang engine (CPU mode), Megatron trainer, the RL loop.

One sync-mode run (staleness 0 by construction, versions advance every step, outputs written, the
engine's logprobs equal the trainer's after every sync, most bytes synced in place) and
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
                        "train.prompts_per_step=4", "train.eval_every=2", "train.save_every=2",
                        "weight_sync.bucket_mb=0.25")  # small buckets: most go in place, straight from the DDP buffer
    steps = [r for r in rows if "step_seconds" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["version"] for r in steps] == [2, 3, 4]  # v1 = after the warm start; +1 per step
    assert all(set(r["staleness_hist"]) == {"0"} for r in steps)  # sync mode: never stale
    # the engine holds the trainer's weights after every sync: its logprobs equal the trainer's (fp32)
    assert all(r["logprob_diff_replay_on"] < 1e-5 and r["sync_in_place_fraction"] > 0.5 for r in steps), steps
    assert all(r["sync_seconds"] > 0 and r["sync_repaired"] == 0 for r in steps)
    assert all(0.0 <= r["reward"] <= 1.0 and r["routing_disagreement"] < 0.05 for r in steps)
    assert any("eval/accuracy" in r for r in rows) and any("sft/nll" in r for r in rows)
    for name in ("config.yaml", "curves.png", "summary.json", "checkpoints/step_2/loop_state.json",
                 "checkpoints/step_3/loop_state.json"):
        assert (run / name).exists(), name
    assert os.listdir(run / "tb")
    # no Transformer Engine on CPU: the local spec ran, and the summary says so
    assert json.load(open(run / "summary.json"))["run"]["trainer_spec"] == "local"


def test_default_run_learns(tmp_path):
    """The README's default run, shortened: the sampled reward must rise clearly."""
    _, rows = mrl_train(tmp_path / "default", "train.steps=70", "train.eval_every=0")
    rewards = [r["reward"] for r in rows if "reward" in r]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"\n[mrl train] reward first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert first < 0.3 and last > first + 0.2, rewards  # README run: 0.03 -> 0.5 by step 70


def test_overlap_run_syncing_every_second_step(tmp_path):
    """``weight_sync.every_n_steps=2`` (the async bench syncs every 3): the version advances at every second
    step only, the other steps train on without pausing the engine, and staleness is counted in versions."""
    _, rows = mrl_train(tmp_path / "every2", "train.steps=4", "weight_sync.every_n_steps=2", "train.sft_warmup_steps=0",
                        "train.prompts_per_step=4", "train.eval_every=0", "train.max_staleness=1")
    steps = [r for r in rows if "step_seconds" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert [r["version"] for r in steps] == [0, 1, 1, 2]
    assert ["sync_seconds" in r for r in steps] == [False, True, False, True]
    assert all(int(k) <= 1 for r in steps for k in r["staleness_hist"]), steps  # max_staleness=1 (drop)
