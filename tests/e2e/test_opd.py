"""On-policy distillation through ``mrl train`` (real SGLang engines for the student and the teacher,
Megatron trainer, Keep Routing on): the run starts a teacher engine of its own, every trained group carries
the teacher's per-token reverse KL, the student's routes still replay exactly, and no teacher process
outlives the run."""

from __future__ import annotations

import os
import re

import psutil

from mrl.models.tiny import make_tiny_model
from tests.e2e.test_train_loop import mrl_train


def _teacher_processes(run) -> list[int]:
    log = open(os.path.join(run, "engines", "teacher0.log")).read()
    port = re.search(r"--port (\d+)", log).group(1)
    return [p.info["pid"] for p in psutil.process_iter(["pid", "cmdline"])
            if "sglang.launch_server" in " ".join(p.info["cmdline"] or []) and port in (p.info["cmdline"] or [])]


def test_opd_run_trains_on_the_teachers_token_rewards(tmp_path):
    teacher = make_tiny_model(str(tmp_path / "teacher"), seed=7)  # other weights, the same tokenizer
    run = tmp_path / "opd"
    _, rows = mrl_train(run, "scoring=opd", f"scoring.teacher.hf_path={teacher}", "train.steps=4",
                        "train.sft_warmup_steps=0", "train.eval_every=0", "train.prompts_per_step=4")
    steps = [r for r in rows if "step_seconds" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    # distillation alone (reward_weight 0): every advantage is the token's teacher - student logprob, whose
    # mean over the student's own samples estimates -KL(student || teacher) < 0 (a step's few groups can
    # land above 0: the run's mean cannot, by much)
    rewards = [r["token_reward"] for r in steps]
    assert sum(rewards) / len(rewards) < 0 and all(x != 0 for x in rewards), rewards
    last = steps[-1]
    assert last["rollout/scoring_teacher_groups"] >= last["rollout/groups_buffered"] > 0
    assert last["rollout/scoring_teacher_groups_failed"] == 0 and last.get("rollout/groups_reward_dropped", 0) == 0
    assert last["rollout/scoring_teacher_engines_healthy"] == 1
    # Keep Routing as without a teacher: tokens sampled by the trainer's own weights match the engine's exactly
    assert all(r["mismatch/numerics_kl"] <= 1e-6 for r in steps if r["mismatch/numerics_tokens"] > 0)
    assert not _teacher_processes(run)
