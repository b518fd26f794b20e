"""A process reward model on a real SGLang engine (CPU) started by the run's pool, its step rewards through
the advantage to the loss (issue 57, proof 5(c)), and a killed PRM engine:

- the PRM: the tiny model's architecture and tokenizer, random weights (another seed) with the sharper head of
  the ``tiny_lora`` preset so that its verdicts differ from step to step;
- each step's p_good read by the engine (one ``token_ids_logprob`` prefill per sample) equals transformers' own
  softmax over the two verdict tokens after the step and its tag (1e-3), and ``weight * (p_good - baseline)``
  lies on the step's last token, 0 elsewhere (a multi-turn sample's turns are its steps);
- the batch's per-token advantages are the GRPO advantage plus the reward-to-go of the steps written out by
  hand (``algo.token_reward_discount=1``), the micro-batch puts them at the positions that predict the tokens,
  and the loss gradient at ratio 1 is -A[t] / (trained tokens) there;
- the PRM engine SIGKILLed between two scorings: replaced, the group rescored to the same values; the
  replacement killed with no restart left: scoring stops the run (``NoScoringEngine``), nothing is trained
  without its score.
"""

from __future__ import annotations

import asyncio
import os
import signal
import types

import pytest
import torch

from mrl.algo import compute_advantages, compute_policy_loss
from mrl.config.load import compose
from mrl.config.schema import Aggregation, AlgoConfig, Correction, TinyPreset
from mrl.data import Prompt
from mrl.models.tiny import make_tiny_model
from mrl.reward import RewardScorer
from mrl.reward.builtin import exact_match
from mrl.rollout.buffer import Group
from mrl.rollout.sample import Sample
from mrl.rollout.scorers import build_scorer
from mrl.scoring import NoScoringEngine, ScoringGroup
from mrl.trainer.batch import build_batch
from mrl.trainer.engines import RunEngines

TOL = 1e-3  # engine vs a reference implementation (tests/integration/test_teacher_scoring.py)
WEIGHT, BASELINE, TAG = 2.0, 0.5, " =>"
EOS = 2


@pytest.fixture(scope="module")
def prm_dir(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("prm") / "tiny_prm"), TinyPreset.tiny_lora, seed=11)


def _episode(tok):
    """Three samples as lists of (text, trained) parts, and each one's step ends written out by hand."""
    enc = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
    parts = [[("3+4=7\n\n", 1), ("so the answer is 7", 1), (None, 1)],
             [("3+4=8\n\n", 1), ("the answer is 8\n\n", 1), ("ok", 1), (None, 1)],
             [("add 3 4\n\n", 1), ("sum", 1), (" 7 ", 0), ("7", 1), (None, 1)]]  # turn, observation, turn
    out = []
    for sample in parts:
        ids, mask, ends = [], [], []
        for text, m in sample:
            piece = [EOS] if text is None else enc(text)
            ids += piece
            mask += [m] * len(piece)
            if text is not None and (text.endswith("\n\n") or m == 0):
                ends.append(len(ids) - (len(piece) if m == 0 else 0))  # an observation closes the turn before it
        ends.append(len(ids))
        out.append((ids, mask, sorted(set(ends))))
    return out


def _hf_verdicts(prm_dir, tok, prompt, samples) -> list[list[float]]:
    """transformers' p_good after each step's tag, the PRM input built here by hand."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(prm_dir, dtype=torch.float32).eval()
    good, bad = tok.encode("+", add_special_tokens=False).ids[0], tok.encode("-", add_special_tokens=False).ids[0]
    tag = tok.encode(TAG, add_special_tokens=False).ids
    out = []
    for ids, _, ends in samples:
        seq, read, prev = list(prompt), [], 0
        for e in ends:
            seq += ids[prev:e] + tag
            read.append(len(seq))
            prev = e
        with torch.no_grad():  # one more token: the logits after the last tag
            lp = torch.log_softmax(m(torch.tensor([seq + [0]])).logits[0].double(), -1)
        out.append([float(torch.sigmoid(lp[r - 1, good] - lp[r - 1, bad])) for r in read])
        near = [float(torch.sigmoid(lp[r - 2, good] - lp[r - 2, bad])) for r in read]
        assert max(abs(a - b) for a, b in zip(out[-1], near)) > 20 * TOL  # reading off by one would show
    return out


def _score(scorer, group):
    async def go():
        return (await scorer.score(group)).check(group, "test")

    return asyncio.run(go())


@pytest.mark.reliability
def test_prm_step_rewards_reach_the_loss_by_hand_and_a_killed_prm_is_replaced(prm_dir, tmp_path, reliability):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(prm_dir, "tokenizer.json"))
    cfg = compose([f"run_dir={tmp_path}", f"model.hf_path={prm_dir}", "scoring=prm", f"scoring.prm.hf_path={prm_dir}",
                   f"scoring.prm.weight={WEIGHT}", f"scoring.prm.baseline={BASELINE}", f"scoring.prm.step_tag='{TAG}'",
                   "scoring.prm.timeout_s=60", "scoring.prm.engine.max_restarts=1", "reward=exact_match",
                   "rollout.n_samples_per_prompt=3", "algo.token_reward_discount=1"])
    group_engines = RunEngines(cfg).side_groups()["prm"]
    prompt = [1] + tok.encode("add 3 4=", add_special_tokens=False).ids
    samples = _episode(tok)
    group = ScoringGroup(Prompt(id="p0", text="add 3 4=", answer="7"), [
        Sample(prompt_ids=prompt, group_id=0, index=i, max_new_tokens=64, response_ids=ids,
               response_logprobs=[-1.0] * len(ids), versions=[0] * len(ids), loss_mask=mask, finish_reason="stop")
        for i, (ids, mask, _) in enumerate(samples)], [tok.decode(ids) for ids, _, _ in samples])
    with RewardScorer(cfg.reward) as rules:
        scorer = build_scorer(cfg, rules, episodes=False, student_path=prm_dir, side_engines={"prm": group_engines})
        try:
            scores = _score(scorer, group)
            want_p = _hf_verdicts(prm_dir, tok, prompt, samples)
            for (ids, mask, ends), tr, ps in zip(samples, scores.token_rewards, want_p):
                at = {e - 1: WEIGHT * (p - BASELINE) for e, p in zip(ends, ps)}
                assert all(mask[t] for t in at)  # steps end on the model's own tokens
                for t, r in enumerate(tr):
                    assert r == pytest.approx(at.get(t, 0.0), abs=WEIGHT * TOL), (t, tr, at)
            assert scores.rewards == [exact_match(group.prompt, t) for t in group.texts]  # the PRM adds 0

            # reward-to-go of the steps, by hand, on the GRPO advantage of reward.fn's outcome
            g = Group(group.prompt, group.samples, [float(r) for r in scores.rewards], group.texts,
                      scores.token_rewards)
            batch, _, info = build_batch([g], cfg, with_routes=False)
            a = compute_advantages(torch.tensor(g.rewards), 3, cfg.algo).tolist()
            for i, ((ids, _, ends), ps) in enumerate(zip(samples, want_p)):
                rewards = [WEIGHT * (p - BASELINE) for p in ps]
                want = [a[i] + sum(r for e, r in zip(ends, rewards) if e - 1 >= t) for t in range(len(ids))]
                assert batch.token_advantages[i] == pytest.approx(want, abs=3 * WEIGHT * TOL)
            trained = sum(sum(mask) for _, mask, _ in samples)
            assert info["token_reward"] == pytest.approx(sum(sum(tr) for tr in scores.token_rewards) / trained)
            _loss_gradient_by_hand(cfg, batch, [len(prompt)] * 3)

            pool = scorer.parts[1][0].pool
            os.killpg(os.getpgid(group_engines.engines[0].proc.pid), signal.SIGKILL)
            again = _score(scorer, group)
            flat = [r for tr in scores.token_rewards for r in tr]
            assert [r for tr in again.token_rewards for r in tr] == pytest.approx(flat, abs=1e-5)
            st = pool.stats()
            assert st["engines_lost"] == 1 and st["engines_restarted"] == 1 and st["engines_healthy"] == 1, st
            assert len(group_engines.engines) == 2 and not group_engines.engines[0].pids()

            os.killpg(os.getpgid(group_engines.engines[1].proc.pid), signal.SIGKILL)
            with pytest.raises(NoScoringEngine, match="no engine left"):
                _score(scorer, group)
            reliability.record(category="fault", name="PRM engine SIGKILLed", injected="SIGKILL of the PRM's "
                               "process group between two scorings", expected="replaced, the group rescored the same",
                               survived=True, message="", details={"stats": st})
        finally:
            asyncio.run(scorer.aclose())
            scorer.close()
    assert not any(e.pids() for e in group_engines.engines)


def _loss_gradient_by_hand(cfg, batch, prompt_lens):
    """The micro-batch puts each token's advantage at the position predicting it; at ratio 1 the token-mean
    loss's gradient there is -A[t] * m[t] / (trained tokens)."""
    from mrl.megatron.policy import Policy

    width = max(len(t) for t in batch.tokens) + 1
    fake = types.SimpleNamespace(cfg=cfg, support_spec=None, codec=None)
    mb = Policy._micro_batch(fake, batch, list(range(len(batch))), None, width, False, 1)
    adv, mask = mb.data["adv"].cpu().double(), mb.data["mask"].cpu().double()
    for b, (row, p) in enumerate(zip(batch.token_advantages, prompt_lens)):
        assert torch.allclose(adv[b, p - 1:p - 1 + len(row)], torch.tensor(row, dtype=torch.float64), atol=1e-6)
        assert adv[b, :p - 1].abs().sum() == 0 and adv[b, p - 1 + len(row):].abs().sum() == 0
        assert mask[b, p - 1:p - 1 + len(row)].tolist() == [float(m) for m in batch.loss_mask[b]]
    algo = AlgoConfig(correction=Correction.none, aggregation=Aggregation.token_mean)
    logp = torch.full(adv.shape, -0.5, dtype=torch.float64, requires_grad=True)
    loss, _ = compute_policy_loss(logp, logp.detach(), logp.detach(), adv, mask, algo)
    loss.backward()
    assert torch.allclose(logp.grad, -adv * mask / float(mask.sum()), atol=1e-12)
