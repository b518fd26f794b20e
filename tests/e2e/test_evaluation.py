"""Evaluation beside training, end to end (real SGLang engine in CPU mode, Megatron trainer): two held-out sets
-- the task's held-out split with greedy pass@1 and sampled pass@k, and a JSONL file with greedy pass@1 --
are generated on the engine while the loop trains, and each result reaches the console, metrics.jsonl,
TensorBoard and the PNG at the step it measured, tagged with the weight versions that generated it."""

from __future__ import annotations

import glob

from tests.e2e.test_train_loop import mrl_train

STEPS = 4


def test_eval_sets_report_pass_at_k_with_their_versions(tmp_path):
    run = tmp_path / "eval"
    p, rows = mrl_train(run, f"train.steps={STEPS}", "train.sft_warmup_steps=2", "train.prompts_per_step=4",
                        "rollout.max_new_tokens=4", "train.eval_every=2", "train.save_at_end=false",
                        "train.save_hf=false",
                        "train.eval_sets=[{name: heldout, max_prompts: 8, n: 4, k: [1, 2, 4]},"
                        " {name: fixture, source: tests/fixtures/data/prompts_eval.jsonl}]")
    steps = [r for r in rows if "step_seconds" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    version_at = {0: 1} | {r["step"]: r["version"] for r in steps}  # v1: the weights after the warm start
    for name, rates in (("heldout", ("greedy_pass_at_1", "pass_at_1", "pass_at_2", "pass_at_4")),
                        ("fixture", ("greedy_pass_at_1",))):
        got = [r for r in rows if f"eval/{name}/version" in r]
        # the first evaluation (before step 1) and the last step's are always reported; the one at step 2
        # unless the first still generated then (skipped, said on the console)
        assert {0, STEPS} <= {r["step"] for r in got} <= {0, 2, STEPS}, got
        for r in got:
            assert all(0.0 <= r[f"eval/{name}/{k}"] <= 1.0 for k in rates), r
            # submitted on the weights of the step it measured; tokens from later versions only if a sync
            # landed while it generated (an honest tag, not a pinned version)
            assert r[f"eval/{name}/version"] == version_at[r["step"]], (r, version_at)
            assert r[f"eval/{name}/version_max"] >= r[f"eval/{name}/version"]
            assert r[f"eval/{name}/failed"] == 0
        if name == "heldout":
            assert all(r["eval/heldout/pass_at_1"] <= r["eval/heldout/pass_at_2"] <= r["eval/heldout/pass_at_4"]
                       for r in got), got
            assert all(r["eval/accuracy"] == r["eval/heldout/greedy_pass_at_1"] for r in got)
    lines = [x for x in p.stdout.splitlines() if x.startswith("[mrl] eval heldout step 0 (v1")]
    assert lines and "greedy pass@1" in lines[0] and "pass@4" in lines[0], p.stdout[-3000:]
    # each step's eval phase is the submission and collection only
    assert all(r.get("eval_seconds", 0.0) < 0.5 for r in steps), [r.get("eval_seconds") for r in steps]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(glob.glob(str(run / "tb"))[0]).Reload()
    assert [e.step for e in tb.Scalars("eval/heldout/pass_at_4")][:1] == [0]
    assert "eval/fixture/greedy_pass_at_1" in tb.Tags()["scalars"]
    assert (run / "curves.png").is_file()
