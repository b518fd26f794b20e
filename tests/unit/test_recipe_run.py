"""bench/recipe_run.py's figures from a run's metrics.jsonl rows: steps, samples and seconds to a reward target,
the clip fractions of the mini-batches after the first, medians with runs that never got there."""

import os
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "bench"))
import recipe_run  # noqa: E402


def _steps(rewards, per_step=128):
    rows = []
    for i, r in enumerate(rewards, 1):
        rows.append({"step": i, "reward": r, "staleness_hist": {"0": per_step * i // 2, "1": per_step * i
                                                                  - per_step * i // 2},
                     "rollout/samples_completed": 150 * i, "wall_seconds": 2.0 * i})
    return rows


def test_target_is_the_first_step_whose_trailing_mean_reaches_it():
    rows = _steps([0.1, 0.95, 0.2, 0.9, 0.9, 0.95, 0.9, 1.0])
    got = recipe_run.to_target(rows, 0.9, 3)
    # trailing means of 3: steps 3.. = 0.417, 0.683, 0.667, 0.917 -> step 6
    assert got == {"steps_to_target": 6, "samples_to_target": 6 * 128, "rollouts_to_target": 900,
                   "seconds_to_target": 12.0}
    assert recipe_run.to_target(rows, 0.9, 1)["steps_to_target"] == 2


def test_a_target_never_reached_is_none_and_counts_beyond_every_run():
    got = recipe_run.to_target(_steps([0.5] * 10), 0.9, 5)
    assert set(got.values()) == {None}
    assert recipe_run.median_beyond([56, None, 53]) == 56
    assert recipe_run.median_beyond([56, None, None]) is None


def test_clip_fractions_of_later_mini_batches_leave_the_first_out():
    rows = [{"clip_frac_high": 0.02, "clip_frac_low": 0.0, "minibatch/0/clip_frac_high": 0.5,
             "minibatch/1/clip_frac_high": 0.01, "minibatch/2/clip_frac_high": 0.03,
             "minibatch/0/clip_frac_low": 0.0, "minibatch/1/clip_frac_low": 0.0, "minibatch/2/clip_frac_low": 0.0},
            {"clip_frac_high": 0.0, "clip_frac_low": 0.0}]
    got = recipe_run.clip_fractions(rows)
    assert got["clip_frac_high"] == [0.02, 0.0]
    assert got["clip_frac_high_later_minibatches"] == [0.02, None]
    pooled = recipe_run.pooled([{"clip": got}], "clip_frac_high")
    assert pooled == {"median": 0.01, "mean": 0.01, "nonzero_steps": 0.5, "steps": 2}
