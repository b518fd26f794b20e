"""On-policy distillation's teacher pool on real SGLang engines (CPU) against megatron-core:

- a teacher with other weights (the tiny model made with another seed, same tokenizer), started by the pool:
  its prefill logprobs of the student's sampled tokens equal megatron's for the teacher's checkpoint (the
  engine-vs-trainer tolerance, 1e-3), and each token reward is teacher minus student logprob;
- the teacher engine SIGKILLed: the next scoring finds it dead, the pool kills what is left and starts a
  replacement, and the group is rescored there to the same values (no score is missing or made up); with
  the restarts spent and the replacement killed too, scoring stops the run (``NoScoringEngine``);
- the student's own engine as its teacher: the reverse KL of its sampled tokens is 0 (within 1e-3).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest

from mrl.config.engine import EngineConfig
from mrl.config.scoring import TeacherConfig
from mrl.data import Prompt
from mrl.engine.group import EngineGroup
from mrl.models.tiny import make_tiny_model
from mrl.rollout.manager import RolloutManager
from mrl.rollout.sample import SamplingSpec
from mrl.scoring import NoScoringEngine, ScoringGroup
from mrl.scoring.pool import ScoringPool
from mrl.scoring.teacher import TeacherScorer
from mrl.sglang.client import EngineClient
from tests.conftest import run_torchrun

PROMPTS = [[1, 17, 42, 99, 7], [1, 300, 5, 9, 11, 250, 3]]
TOL = 1e-3  # engine vs trainer logprobs (tests/integration/test_sglang_engine.py)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("teacher") / "tiny_seed7"), seed=7)


@pytest.fixture(scope="module")
def groups(engines):
    """Two groups of three samples from the student's engine at temperature 1."""
    async def go():
        mgr = RolloutManager([EngineClient(engines["tp1"].url)], sampling=SamplingSpec(max_new_tokens=8, seed=3))
        return [ScoringGroup(Prompt(id=f"p{i}", text="", answer=""), await mgr.generate_group(p, 3, i), [""] * 3)
                for i, p in enumerate(PROMPTS)]

    return asyncio.run(go())


def _cfg(**engine) -> TeacherConfig:
    return TeacherConfig(hf_path="-", timeout_s=60, health_timeout_s=600,
                         engine=EngineConfig(cpu_threads=1, max_running_requests=16, **engine))


def _score_all(scorer: TeacherScorer, groups) -> list[list[list[float]]]:
    async def go():
        try:
            return [(await scorer.score(g)).token_rewards for g in groups]
        finally:
            await scorer.aclose()

    return asyncio.run(go())


def _megatron_logprobs(hf: str, seqs: list[list[int]], d) -> list[list[float]]:
    (d / "in.json").write_text(json.dumps({"sequences": seqs}))
    r = run_torchrun("tests.jobs.score", ["--hf", hf, "--input", str(d / "in.json"), "--out", str(d / "out.json")], 1)
    assert r.returncode == 0, r.stderr[-3000:]
    return [x["logprobs"] for x in json.loads((d / "out.json").read_text())["results"]]


@pytest.mark.reliability
def test_teacher_scores_equal_megatron_and_a_killed_teacher_is_replaced(teacher_dir, groups, tmp_path, reliability):
    cfg = _cfg(max_restarts=1)
    group = EngineGroup(cfg.engine, teacher_dir, log_dir=str(tmp_path / "engines"), name="teacher",
                        health_timeout_s=cfg.health_timeout_s)
    pool = ScoringPool(cfg, group).start()
    scorer = TeacherScorer(cfg, pool)
    try:
        first = _score_all(scorer, groups)
        samples = [s for g in groups for s in g.samples]
        want = _megatron_logprobs(teacher_dir, [s.tokens for s in samples], tmp_path)
        rewards = [tr for g in first for tr in g]
        worst = 0.0
        for s, tr, lp in zip(samples, rewards, want):
            p = len(s.prompt_ids)
            teacher = [r + b for r, b in zip(tr, s.response_logprobs)]  # coef 1: r = teacher - student
            megatron = lp[p - 1:p - 1 + len(s.response_ids)]  # lp[k] is token k + 1's
            worst = max(worst, max(abs(a - b) for a, b in zip(teacher, megatron)))
        assert worst < TOL, worst
        kl = sum(abs(r) for tr in rewards for r in tr) / sum(len(tr) for tr in rewards)
        assert kl > 0.05, f"a teacher with other weights should disagree with the student: mean |KL| {kl}"

        os.killpg(os.getpgid(group.engines[0].proc.pid), signal.SIGKILL)
        again = _score_all(scorer, groups)
        for a, b in zip([r for g in again for tr in g for r in tr], [r for tr in rewards for r in tr]):
            assert abs(a - b) < 1e-5
        st = pool.stats()
        assert st["engines_lost"] == 1 and st["engines_restarted"] == 1 and st["engines_healthy"] == 1, st
        assert len(group.engines) == 2 and not group.engines[0].pids()  # the dead one's processes are gone

        os.killpg(os.getpgid(group.engines[1].proc.pid), signal.SIGKILL)
        with pytest.raises(NoScoringEngine, match="no engine left"):
            _score_all(scorer, groups[:1])
        reliability.record(category="fault", name="teacher engine SIGKILLed", injected="SIGKILL of the teacher's "
                           "process group between two scorings", expected="replaced, the group rescored the same",
                           survived=True, message="", details={"max_logprob_gap_vs_megatron": worst, "stats": st})
    finally:
        pool.close()
    assert not any(e.pids() for e in group.engines)


def test_the_students_own_engine_as_teacher_gives_zero_reverse_kl(engines, groups):
    cfg = _cfg(urls=[engines["tp1"].url])
    scorer = TeacherScorer(cfg, ScoringPool(cfg).start())
    rewards = [r for g in _score_all(scorer, groups) for tr in g for r in tr]
    assert rewards and max(abs(r) for r in rewards) < TOL
