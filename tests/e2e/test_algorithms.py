"""DAPO and GSPO through the whole loop (real SGLang engine, Megatron trainer), with KL to a reference,
and the loop's mechanics, several per run (each `mrl train` run costs minutes on the 2-core box).

Their losses are unit-tested against hand-computed values (tests/unit/test_algo.py); here the loop
must feed them what they need: DAPO's dynamic sampling keeps groups without signal out of every batch
(and counts them), overlong shaping runs, the KL to the reference is exactly 0 while the policy still is
the reference and grows after; GSPO's sequence-level ratio trains in sync mode with Keep Sampling Mask on
(top-k sampling). With one optimizer step per batch the ratio is 1 and no clip acts (DAPO's clip-higher
included); the multi-turn DAPO run takes two mini-batches per batch, so its second step's ratio moves.
The DAPO run (overlap) also syncs only every second step and saves its checkpoints asynchronously; the
GSPO run (sync mode) also writes every output and checkpoints, and syncs in small buckets, most of them in
place from the DDP buffer.
"""

from __future__ import annotations

import json
import os
import sys

from tests.e2e.test_train_loop import REPO, mrl_train


def test_dapo_overlap_with_kl_to_reference_syncing_every_second_step(tmp_path):
    run = tmp_path / "dapo"
    p, rows = mrl_train(run, "algo=dapo", "algo.kl_coef=0.05", "algo.overlong_buffer_len=2",
                        "rollout.max_new_tokens=6", "train.steps=5", "train.sft_warmup_steps=2",
                        # a reward with signal in most groups but not all: the run does not wait for the
                        # policy to learn the task before its groups have any
                        "reward.fn=tests.e2e.reward_fns.text_parity", "weight_sync.every_n_steps=2",
                        "train.max_staleness=1", "train.save_every=2", "train.async_save=true",
                        "train.prompts_per_step=4", "train.eval_every=0", "train.bad_routes=drop")
    steps = [r for r in rows if "step_seconds" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    # train.async_save: each save is staged, written by a forked process while the run goes on, and
    # completed (megatron's metadata, then the loop state that marks it) at a later step or the run's end
    staged = [x.split()[2] for x in p.stdout.splitlines() if x.startswith("[mrl] checkpoint ") and " staged in " in x]
    done = [x.split()[2] for x in p.stdout.splitlines() if x.startswith("[mrl] checkpoint ") and " complete: " in x]
    assert staged == ["step_2:", "step_4:", "step_5:"] and done == ["step_2", "step_4", "step_5"], p.stdout
    for n in (2, 4, 5):
        assert (run / "checkpoints" / f"step_{n}" / "loop_state.json").is_file()
        assert (run / "checkpoints" / f"step_{n}" / ".metadata").is_file()
    sys.path.insert(0, os.path.join(REPO, "bench"))
    import loop_e2e  # the GPU bench reads these lines into its report

    saves = loop_e2e.checkpoint_saves(p.stdout)
    assert [c["step"] for c in saves] == [2, 4, 5], saves
    assert all(c["gib"] > 0 and 0 < c["staged_s"] <= c["seconds"] for c in saves), saves
    # weight_sync.every_n_steps=2: the version (v1 = after the warm start) advances at every second step
    # only, the other steps train on without pausing the engine; staleness is counted in versions
    assert [r["version"] for r in steps] == [1, 2, 2, 3, 3]
    assert ["sync_seconds" in r for r in steps] == [False, True, False, True, False]
    assert all(int(k) <= 1 for r in steps for k in r["staleness_hist"]), steps  # max_staleness=1 (drop)
    # dynamic sampling: no trained group is without signal, the ones skipped are counted
    assert all(r["groups_without_signal"] == 0 for r in steps)
    assert steps[-1]["rollout/groups_no_signal"] > 0
    # the first step trains the reference itself (v1 = after the warm start): KL exactly 0, then > 0
    assert steps[0]["kl_ref"] == 0.0
    assert all(r["kl_ref"] > 0.0 for r in steps[2:])
    assert all(k in steps[-1] for k in ("clip_frac_high", "clip_frac_low", "is_weight_mean"))
    # the mismatch split knows the trainer's weights from its pushes: after an unpushed update (steps 2 and 4)
    # no token was sampled by them, and every token counts as stale; step 1 trains on v1's own tokens, exactly
    assert [r["mismatch/numerics_tokens"] == 0 for r in steps][1::2] == [True, True]
    assert all(r["mismatch/stale_tokens"] > 0 for r in steps[1::2])
    assert steps[0]["mismatch/numerics_tokens"] > 0 and steps[0]["mismatch/numerics_kl"] <= 1e-6
    assert all(r["mismatch/numerics_kl"] <= 1e-6 for r in steps if r["mismatch/numerics_tokens"] > 0)


def test_gspo_sync_with_sampling_mask_writes_everything(tmp_path):
    """GSPO in sync mode, top-k sampling with Keep Sampling Mask, on multi-turn episodes (data=lookup: tool
    calls, observations with loss mask 0): the trainer's logprobs over the engine's support equal the
    engine's own (renormalized on that support) -- same weights, same routes. The run's outputs,
    checkpoints and in-place sync are checked on the same run."""
    run = tmp_path / "gspo"
    p, rows = mrl_train(run, "algo=gspo", "data=lookup", "train.mode=sync", "train.steps=3",
                        "train.sft_warmup_steps=2", "train.prompts_per_step=4", "train.eval_every=2",
                        "train.save_every=2", "rollout.top_k=4", "train.sampling_mask=true",
                        "weight_sync.bucket_mb=0.25")  # small buckets: most go in place, straight from the DDP buffer
    steps = [r for r in rows if "step_seconds" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["version"] for r in steps] == [2, 3, 4]  # v1 = after the warm start; +1 per step
    assert all(set(r["staleness_hist"]) == {"0"} for r in steps)  # sync mode: never stale
    assert all(r["sync_seconds"] > 0 and r["sync_repaired"] == 0 and r["sync_in_place_fraction"] > 0.5
               for r in steps), steps
    phases = ("check", "pause", "push", "finish", "barrier")  # where each sync's seconds went, adding up
    assert all(0 < sum(r[f"sync/{k}_seconds"] for k in phases) <= r["sync_seconds"] for r in steps), steps
    assert all(0.0 <= r["reward"] <= 1.0 and r["routing_disagreement"] < 0.05 for r in steps)
    assert any("eval/accuracy" in r for r in rows) and any("sft/nll" in r for r in rows)
    for name in ("config.yaml", "curves.png", "summary.json", "checkpoints/step_2/loop_state.json",
                 "checkpoints/step_3/loop_state.json"):
        assert (run / name).exists(), name
    # each save is announced and its size and time reported (minutes for a large model)
    saved = [x for x in p.stdout.splitlines() if x.startswith("[mrl] checkpoint step_")]
    assert [x.split()[2] for x in saved] == ["step_2", "step_3"] and all(" GiB in " in x for x in saved), saved
    sys.path.insert(0, os.path.join(REPO, "bench"))
    import loop_e2e  # the GPU bench reads these lines into its report

    assert [c["step"] for c in loop_e2e.checkpoint_saves(p.stdout)] == [2, 3]
    assert all(c["gib"] > 0 and c["seconds"] > 0 for c in loop_e2e.checkpoint_saves(p.stdout))
    assert "(optimizer state: dp_reshardable)" in p.stdout
    assert os.listdir(run / "tb")
    # no Transformer Engine on CPU: the local spec ran, and the summary says so
    assert json.load(open(run / "summary.json"))["run"]["trainer_spec"] == "local"
    # sync mode, one optimizer step per batch: the sequence ratio is 1, nothing can be clipped
    assert all(r["clip_frac_high"] == 0.0 and r["clip_frac_low"] == 0.0 for r in steps)
    assert all(r["support_unknown_tokens"] == 0 and r["outside_support_tokens"] == 0 for r in steps)
    assert all(r["logprob_diff_replay_on"] < 1e-4 for r in steps)
    # sync mode: every token was sampled by the weights the trainer scores it with (the numerics part only)
    assert all(r["mismatch/stale_tokens"] == 0 and r["mismatch/numerics_tokens"] > 0
               and r["mismatch/numerics_kl"] <= 1e-6 for r in steps), steps
    assert all(r["rollout/env_episodes"] > 0 for r in steps)  # the samples were episodes of the environment


def test_dapo_on_multi_turn_episodes(tmp_path):
    """DAPO (dynamic sampling, overlong shaping, clip-higher from the second of two mini-batches per batch) in
    the async loop on multi-turn episodes (data=lookup after a warm start that makes the policy call its tool
    in most episodes): no trained group lacks signal, the skipped ones are counted, and the episodes really
    had several turns; the first mini-batch trains at ratio 1, the second against the policy before the
    first step. Run with train.save_at_end=false: it ends without a checkpoint."""
    run = tmp_path / "dapo_mt"
    p, rows = mrl_train(run, "data=lookup", "algo=dapo", "algo.max_response_len=32", "train.sft_warmup_steps=70",
                        "algo.lr=3e-4", "train.steps=4", "train.eval_every=0", "train.save_at_end=false",
                        "algo.mini_batches=2")
    assert not (run / "checkpoints").exists() or not os.listdir(run / "checkpoints"), os.listdir(run / "checkpoints")
    assert "saving checkpoint" not in p.stdout
    steps = [r for r in rows if "step_seconds" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["groups_without_signal"] == 0 for r in steps)
    assert steps[-1]["rollout/groups_no_signal"] > 0
    assert all(r["rollout/env_turns_per_episode"] > 1.2 for r in steps)  # tool calls, observations, answers
    assert all(k in steps[-1] for k in ("clip_frac_high", "clip_frac_low", "is_weight_mean"))
    assert "2 optimizer step(s) per rollout batch" in p.stdout
    assert all(r["minibatch/0/ratio_mean"] == 1.0 and r["minibatch/0/clip_frac_high"] == 0.0 for r in steps)
    assert all(r["minibatch/1/approx_kl"] > 0 for r in steps), steps  # pi moved away from pi_old
    # episodes whose turns span a sync included: the trainer's own tokens match the engine's exactly (fp32)
    exact = [r for r in steps if r["mismatch/numerics_tokens"] > 0]
    assert exact and all(r["mismatch/numerics_kl"] <= 1e-6 and r["mismatch/numerics_logprob_diff"] <= 1e-6
                         for r in exact), steps
