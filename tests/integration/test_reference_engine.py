"""The KL reference on engines (``scoring.reference``) against the trainer's own reference, real SGLang (CPU)
and real megatron-core (one gloo rank, in process):

- the reference engine, started by the run's pool from another checkpoint (the tiny model with another seed,
  the same tokenizer), prefills each sample and fills ``Sample.ref_logprobs``; they equal the logprobs the
  trainer computes with the same checkpoint's weights swapped in (``ReferenceWeights.fill``), within the
  engine-vs-trainer tolerance (1e-3);
- the same batch trained by ``Policy.rl_step`` twice from the same policy weights: with the trainer's swapped
  reference, and with the engines' logprobs carried by the batch (``RLBatch.ref_logp``; the policy then holds
  no reference weights): the KL term of the loss is the same, and so is the policy-gradient term;
- the reference engine SIGKILLed between two scorings: replaced, the group's reference logprobs come back the
  same; the replacement killed with no restart left: scoring stops the run (``NoScoringEngine``), the group keeps
  no reference logprobs, and a batch of it is refused (no sample trained without its reference).
"""

from __future__ import annotations

import asyncio
import copy
import os
import signal

import numpy as np
import pytest

from mrl.config.load import compose
from mrl.data import Prompt
from mrl.models.tiny import make_tiny_model
from mrl.reward import RewardScorer
from mrl.rollout.buffer import Group
from mrl.rollout.sample import Sample
from mrl.rollout.scorers import build_scorer
from mrl.scoring import NoScoringEngine, ScoringGroup
from mrl.trainer.batch import build_batch
from mrl.trainer.engines import RunEngines
from tests.conftest import one_rank_gloo_world

TOL = 1e-3  # engine vs trainer logprobs (tests/integration/test_sglang_engine.py)
N = 4


def _samples(vocab: int) -> list[Sample]:
    g = np.random.default_rng(5)
    out = []
    for i in range(N):
        p, r = int(g.integers(3, 7)), int(g.integers(4, 10))
        ids = g.integers(3, vocab, p + r).tolist()
        out.append(Sample(prompt_ids=[1] + ids[:p], group_id=0, index=i, max_new_tokens=16, response_ids=ids[p:],
                          response_logprobs=(-g.random(r) * 3 - 4).tolist(), versions=[0] * r, loss_mask=[1] * r,
                          finish_reason="length"))
    return out


def _kill(engine) -> None:
    os.killpg(os.getpgid(engine.proc.pid), signal.SIGKILL)


@pytest.mark.reliability
def test_engine_reference_logprobs_and_kl_equal_the_trainers_and_a_killed_reference_is_replaced(tmp_path,
                                                                                               reliability):
    policy_dir = make_tiny_model(str(tmp_path / "policy"))
    ref_dir = make_tiny_model(str(tmp_path / "reference"), seed=7)  # other weights, the same tokenizer
    common = [f"run_dir={tmp_path / 'run'}", f"model.hf_path={policy_dir}", "algo.kl_coef=0.5",
              "train.sft_warmup_steps=0", f"rollout.n_samples_per_prompt={N}", "train.micro_batch_size=2",
              "algo.lr=1e-2"]
    cfg = compose(common + ["scoring=reference", f"scoring.reference.hf_path={ref_dir}",
                            "scoring.reference.timeout_s=60", "scoring.reference.engine.max_restarts=1"])
    engines = RunEngines(cfg).side_groups()["reference"]
    assert engines.engines[0].model_path == ref_dir
    samples = _samples(vocab=500)
    group = ScoringGroup(Prompt(id="p0", text="", answer="x"), samples, ["x", "y", "x", "z"])
    with RewardScorer(cfg.reward) as rules:
        scorer = build_scorer(cfg, rules, episodes=False, student_path=policy_dir,
                              side_engines={"reference": engines})
        try:
            scores = asyncio.run(scorer.score(group)).check(group, "test")

            def rescored(fresh: list[Sample]) -> ScoringGroup:  # the group's samples, no reference logprobs yet
                for s in fresh:
                    s.ref_logprobs = []
                return ScoringGroup(group.prompt, fresh, group.texts)

            pool = scorer.parts[1][0].pool
            _kill(engines.engines[0])
            again = rescored(copy.deepcopy(samples))
            asyncio.run(scorer.score(again)).check(again, "test")
            for a, b in zip(again.samples, samples):
                assert a.ref_logprobs == pytest.approx(b.ref_logprobs, abs=1e-5)
            st = pool.stats()
            assert st["engines_lost"] == 1 and st["engines_restarted"] == 1 and st["engines_healthy"] == 1, st
            assert len(engines.engines) == 2 and not engines.engines[0].pids()  # the dead one's processes are gone

            _kill(engines.engines[1])
            lost = rescored(copy.deepcopy(samples))
            with pytest.raises(NoScoringEngine, match="no engine left"):
                asyncio.run(scorer.score(lost))
            assert not any(s.ref_logprobs for s in lost.samples)
            with pytest.raises(ValueError, match="scoring.reference: sample 0 of group 0 has 0"):
                build_batch([Group(group.prompt, lost.samples, [0.0] * N, group.texts)], cfg, with_routes=False)
            reliability.record(category="fault", name="reference engine SIGKILLed", injected="SIGKILL of the "
                               "reference's process group between two scorings", expected="replaced, the reference "
                               "logprobs come back the same; none left: the run stops, nothing trained without them",
                               survived=True, message="", details={"stats": st})
        finally:
            asyncio.run(scorer.aclose())
            scorer.close()
    assert not any(e.pids() for e in engines.engines)
    assert all(len(s.ref_logprobs) == len(s.response_ids) for s in samples)
    groups = [Group(group.prompt, samples, [float(r) for r in scores.rewards], group.texts)]
    engine_batch, norm, _ = build_batch(groups, cfg, with_routes=False)
    trainer_cfg = compose(common)
    trainer_batch, _, _ = build_batch(groups, trainer_cfg, with_routes=False)
    assert trainer_batch.ref_logp is None and engine_batch.ref_logp == [s.ref_logprobs for s in samples]

    with one_rank_gloo_world():
        from mrl.megatron.parallel import init_parallel
        from mrl.megatron.policy import Policy

        def policy(c, hf):
            return Policy(c, init_parallel(c.parallel, seed=c.seed), hf)

        trainer = policy(trainer_cfg, policy_dir)
        trainer.reference.capture(policy(compose(common[:2] + ["train.sft_warmup_steps=0"]), ref_dir).module)
        mbs, idx = trainer.micro_batches(trainer_batch, False, None)
        trainer.reference.fill(trainer.model, trainer.layout, [mbs], dict(
            vocab_size=trainer.bridge.vocab_size, driver=None, support=None, temperature=trainer.temperature,
            fused_logprob=trainer.fused_logprob))
        worst = 0.0
        for mb in mbs:
            for b, i in enumerate(mb.samples):
                p, n = len(samples[i].prompt_ids), len(samples[i].response_ids)
                got = mb.data["ref"][b, p - 1:p - 1 + n].tolist()
                worst = max(worst, max(abs(a - c) for a, c in zip(got, samples[i].ref_logprobs)))
        assert worst < TOL, worst
        want = trainer.rl_step(trainer_batch, norm)

        on_engines = policy(cfg, policy_dir)
        assert on_engines.reference is None  # nothing to swap: the batch carries the reference
        got = on_engines.rl_step(engine_batch, norm)
    assert want["kl_ref"] > 0.005, want  # the reference's other weights: a KL the comparison can see
    assert got["kl_ref"] == pytest.approx(want["kl_ref"], rel=1e-3, abs=1e-5)
    assert got["pg_loss"] == pytest.approx(want["pg_loss"], rel=1e-5, abs=1e-7)
    print(f"kl_ref: trainer {want['kl_ref']:.6f}, engines {got['kl_ref']:.6f}; worst logprob gap {worst:.2e}")
