"""The group scorer interface (``mrl.scoring``): reward.fn as the simplest scorer, composition (weighted sum,
gate), user scorers by dotted path, token rewards into the advantage by hand, and through the batch to the
micro-batch the loss reads."""

from __future__ import annotations

import asyncio
import types

import numpy as np
import pytest
import torch

from mrl.algo import compute_advantages, compute_policy_loss, token_advantages
from mrl.config.load import compose
from mrl.config.schema import Aggregation, AlgoConfig, Correction, RewardConfig, RewardOnError
from mrl.data import Prompt
from mrl.reward import RewardScorer
from mrl.rollout.buffer import Group
from mrl.rollout.sample import Sample
from mrl.rollout.scorers import EnvScorer, RuleScorer, build_scorer
from mrl.scoring import Gate, GroupScores, ScoringGroup, WeightedSum, load_scorer
from mrl.trainer.batch import build_batch
from tests.unit.scorers import DropsFirst, Length

P = Prompt(id="p0", text="last cab=", answer="b")


def _sample(i: int, response: list[int], mask: list[int] | None = None, logp: float = -1.0) -> Sample:
    n = len(response)
    return Sample(prompt_ids=[1, 5, 6], group_id=0, index=i, max_new_tokens=8, response_ids=response,
                  response_logprobs=[logp] * n, versions=[0] * n, loss_mask=mask or [1] * n, finish_reason="stop")


def _group(texts=("b", "c", "b\n", "x")) -> ScoringGroup:
    return ScoringGroup(P, [_sample(i, [10 + i] * (i + 1)) for i in range(len(texts))], list(texts))


def run(coro):
    return asyncio.run(coro)


def test_reward_fn_is_the_simplest_scorer():
    with RewardScorer(RewardConfig()) as rewards:
        got = run(RuleScorer(rewards).score(_group()))
    assert got.rewards == [1.0, 0.0, 1.0, 0.0] and got.token_rewards is None and got.errors == [None] * 4


def test_a_dropped_reward_drops_the_sample():
    cfg = RewardConfig(fn="tests.unit.reward_fns.boom", on_error=RewardOnError.drop)
    with RewardScorer(cfg) as rewards:
        got = run(RuleScorer(rewards).score(_group(("b", "c"))))
    assert got.dropped and got.rewards == [None, None] and all("boom" in e for e in got.errors)


def test_env_scorer_reads_the_episode_reward():
    g = _group(("a", "b"))
    g.samples[0].reward, g.samples[1].reward = 0.5, 2.0
    assert run(EnvScorer().score(g)).rewards == [0.5, 2.0]


def test_turns_are_the_model_spans():
    g = ScoringGroup(P, [_sample(0, [1, 2, 3, 4, 5, 6], mask=[1, 1, 0, 0, 1, 1]), _sample(1, [7, 8])], ["", ""])
    assert g.turns(0) == [(0, 2), (4, 6)] and g.turns(1) == [(0, 2)]


def test_weighted_sum_of_rewards_and_token_rewards():
    g = _group(("b", "c", "b", "x"))
    with RewardScorer(RewardConfig()) as rewards:
        got = run(WeightedSum([(RuleScorer(rewards), 2.0), (Length(per_token=0.5), -0.25)]).score(g))
    # reward = 2 * exact_match - 0.25 * length (lengths 1..4); tokens: -0.25 * 0.5 each
    assert got.rewards == [2 - 0.25, -0.5, 2 - 0.75, -1.0]
    assert got.token_rewards == [[-0.125] * n for n in (1, 2, 3, 4)]


def test_weighted_sum_drops_what_a_part_drops():
    got = run(WeightedSum([(Length(), 1.0), (DropsFirst(), 1.0)]).score(_group()))
    assert got.rewards == [None, 3.0, 4.0, 5.0] and got.dropped and got.errors[0] == "judge said no"


def test_gate_zeroes_the_model_score_where_the_check_fails():
    with RewardScorer(RewardConfig()) as rewards:
        gate = Gate(RuleScorer(rewards), Length(scale=1.0, per_token=1.0), threshold=1.0)
        got = run(gate.score(_group(("b", "c", "b", "x"))))
    assert got.rewards == [1.0, 0.0, 3.0, 0.0]  # lengths where exact_match = 1, else 0
    assert got.token_rewards == [[1.0], [0.0, 0.0], [1.0] * 3, [0.0] * 4]
    assert gate.stats()["closed_gates"] == 2


def test_scores_of_the_wrong_shape_are_refused():
    g = _group(("a", "b"))
    with pytest.raises(ValueError, match="judge: 1 rewards for a group of 2"):
        GroupScores(rewards=[1.0]).check(g, "judge")
    with pytest.raises(ValueError, match="sample 1 has 2 response tokens, 1 token rewards"):
        GroupScores(rewards=[1.0, 1.0], token_rewards=[[0.0], [0.0]]).check(g, "judge")


def test_user_scorers_load_by_dotted_path_with_clear_errors():
    assert isinstance(load_scorer("tests.unit.scorers.Length", {"scale": 2.0}), Length)
    with pytest.raises(ValueError, match="module 'tests.unit.nope' not found"):
        load_scorer("tests.unit.nope.X")
    with pytest.raises(ValueError, match="has no attribute 'Missing'"):
        load_scorer("tests.unit.scorers.Missing")
    with pytest.raises(ValueError, match="cannot take args"):
        load_scorer("tests.unit.scorers.Length", {"bogus": 1})
    with pytest.raises(ValueError, match="not an mrl.scoring.Scorer"):
        load_scorer("tests.unit.scorers.NotAScorer")


def test_build_scorer_default_is_reward_fn_alone_and_overrides_compose():
    cfg = compose(["reward=exact_match"])
    with RewardScorer(cfg.reward) as rewards:
        assert isinstance(build_scorer(cfg, rewards, episodes=False, student_path="-"), RuleScorer)
        assert isinstance(build_scorer(cfg, rewards, episodes=True, student_path="-"), EnvScorer)
        cfg = compose(["scoring.reward_weight=0.5",
                       "scoring.scorers=[{cls: tests.unit.scorers.Length, weight: 2.0, gated: true}]"])
        s = build_scorer(cfg, rewards, episodes=False, student_path="-")
        got = run(s.score(_group(("b", "c"))))
    assert isinstance(s, WeightedSum) and isinstance(s.parts[1][0], Gate)
    assert got.rewards == [0.5 * 1 + 2.0 * 1, 0.0]


def test_scoring_config_refuses_nothing_to_score():
    with pytest.raises(ValueError, match="scoring.reward_weight: is 0 and no other scorer"):
        compose(["scoring.reward_weight=0"])
    with pytest.raises(ValueError, match="scoring.teacher.coef"):
        compose(["scoring.teacher.coef=0"])
    with pytest.raises(ValueError, match="algo.token_reward_discount"):
        compose(["algo.token_reward_discount=2"])


# -- token rewards into the advantage --------------------------------------------------------------------
def test_token_advantages_by_hand():
    adv = torch.tensor([0.5, -0.5])
    r = [[1.0, 2.0, 3.0], [0.5, -1.0]]
    assert token_advantages(adv, r, discount=0.0) == [[1.5, 2.5, 3.5], [0.0, -1.5]]
    # reward-to-go: G = [6, 5, 3] and [-0.5, -1]
    assert token_advantages(adv, r, discount=1.0) == [[6.5, 5.5, 3.5], [-1.0, -1.5]]
    # discount 0.5, sample 0's middle token an observation (mask 0): G2 = 3, G1 = 0 + 1.5, G0 = 1 + 0.75
    assert token_advantages(adv, r, discount=0.5, loss_masks=[[1, 0, 1], [1, 1]]) == [
        [0.5 + 1.75, 0.5 + 1.5, 0.5 + 3.0], [-0.5 + 0.5 - 0.5, -0.5 - 1.0]]
    with pytest.raises(ValueError, match="discount must be in"):
        token_advantages(adv, r, discount=1.5)


def _groups_with_token_rewards() -> list[Group]:
    s = [_sample(i, [10 + i] * n, logp=-0.5) for i, n in enumerate((2, 3))]
    t = [_sample(i, [20 + i] * n, logp=-0.5) for i, n in enumerate((1, 2))]
    return [Group(P, s, [1.0, 0.0], ["", ""], token_rewards=[[0.1, -0.2], [0.3, 0.0, -0.4]]),
            Group(P, t, [0.0, 0.0], ["", ""])]  # no token rewards: 0 at every token


def test_build_batch_carries_per_token_advantages_by_hand():
    cfg = compose(["rollout.n_samples_per_prompt=2", "algo.token_reward_discount=0"])
    batch, _, info = build_batch(_groups_with_token_rewards(), cfg, with_routes=False)
    a = compute_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 2, cfg.algo).tolist()  # GRPO: +-0.7071, 0, 0
    assert batch.advantages == a
    want = [[a[0] + 0.1, a[0] - 0.2], [a[1] + 0.3, a[1], a[1] - 0.4], [0.0], [0.0, 0.0]]
    for got, w in zip(batch.token_advantages, want):
        assert got == pytest.approx(w, abs=1e-7)
    assert info["token_reward"] == pytest.approx((0.1 - 0.2 + 0.3 - 0.4) / 8)
    plain, _, _ = build_batch([Group(P, [_sample(0, [3]), _sample(1, [4])], [1.0, 0.0], ["", ""])], cfg, False)
    assert plain.token_advantages is None


def test_teacher_clip_bounds_each_token_reward_and_reaches_the_advantage():
    """scoring.teacher.clip c: r[t] = coef * clip(teacher - student, -c, c), by hand, through build_batch."""
    from mrl.scoring.teacher import opd_token_rewards

    teacher, student, mask = [-10.3, -0.5, -0.02, -4.0], [-0.7, -3.5, -0.01, -1.0], [1, 1, 1, 0]
    # log ratios -9.6, 3.0, -0.01 and an observation (mask 0); coef 0.5
    assert opd_token_rewards(teacher, student, mask, coef=0.5) == pytest.approx([-4.8, 1.5, -0.005, 0.0])
    got = opd_token_rewards(teacher, student, mask, coef=0.5, clip=2.0)
    assert got == pytest.approx([-1.0, 1.0, -0.005, 0.0])
    cfg = compose(["rollout.n_samples_per_prompt=2", "scoring=opd", "scoring.teacher.hf_path=-",
                   "scoring.teacher.clip=2.0"])
    assert cfg.scoring.teacher.clip == 2.0
    s = [_sample(0, [10, 11, 12, 13], mask=mask), _sample(1, [14])]
    g = Group(P, s, [0.0, 0.0], ["", ""], token_rewards=[got, [0.25]])
    batch, _, _ = build_batch([g], cfg, with_routes=False)
    # reward_weight 0: the group advantage is 0, so each token's advantage is its clipped reward alone
    assert batch.token_advantages[0] == pytest.approx([-1.0, 1.0, -0.005, 0.0])
    assert batch.token_advantages[1] == pytest.approx([0.25])
    with pytest.raises(ValueError, match="scoring.teacher.clip"):
        compose(["scoring.teacher.clip=0"])


def test_token_advantages_reach_the_loss_micro_batch_and_its_gradient():
    """The micro-batch the policy builds puts each token's advantage at the position that predicts the token,
    and the loss's gradient at ratio 1 is -A[t] / (trained tokens) there (token_mean, no correction)."""
    from mrl.megatron.policy import Policy

    cfg = compose(["rollout.n_samples_per_prompt=2"])
    batch, _, _ = build_batch(_groups_with_token_rewards()[:1], cfg, with_routes=False)
    fake = types.SimpleNamespace(cfg=cfg, support_spec=None, codec=None)
    mb = Policy._micro_batch(fake, batch, [0, 1], None, 8, False, 1)
    adv, mask = mb.data["adv"].cpu(), mb.data["mask"].cpu()
    assert adv.shape == (2, 7)
    p = 3  # prompt length: position p - 1 predicts the first response token
    for b, row in enumerate(batch.token_advantages):
        assert torch.equal(adv[b, p - 1:p - 1 + len(row)], torch.tensor(row, dtype=torch.float32))
        assert adv[b, :p - 1].abs().sum() == 0 and adv[b, p - 1 + len(row):].abs().sum() == 0
    algo = AlgoConfig(correction=Correction.none, aggregation=Aggregation.token_mean)
    logp = torch.full((2, 7), -0.5, dtype=torch.float64, requires_grad=True)
    loss, _ = compute_policy_loss(logp, logp.detach(), logp.detach(), adv.double(), mask.double(), algo)
    loss.backward()
    n = float(mask.sum())
    assert torch.allclose(logp.grad, -adv.double() * mask.double() / n, atol=1e-12)
    assert np.isclose(float(loss), -float((adv * mask).sum()) / n)


# -- preflight ------------------------------------------------------------------------------------------
def _teacher_copy(src: str, dst, *, extra_token: str | None = None, eos: int | None = None) -> str:
    import json
    import shutil

    from tokenizers import Tokenizer

    shutil.copytree(src, dst)
    if extra_token:
        tok = Tokenizer.from_file(str(dst / "tokenizer.json"))
        tok.add_tokens([extra_token])
        tok.save(str(dst / "tokenizer.json"))
    if eos is not None:
        c = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps(c | {"eos_token_id": eos}))
    return str(dst)


def test_preflight_refuses_a_teacher_with_another_tokenizer(ckpt_dir, tmp_path):
    from mrl.preflight import check_reward_fn as check_scoring

    student = ckpt_dir["tiny"]

    def check(teacher):
        return check_scoring(compose([f"model.hf_path={student}", "scoring=opd",
                                      f"scoring.teacher.hf_path={teacher}"]), "local")

    assert check(_teacher_copy(student, tmp_path / "same")) is None
    msg = check(_teacher_copy(student, tmp_path / "extra", extra_token="<think>"))
    assert "must share the policy's tokenizer" in msg and "1 only in the teacher's" in msg and "<think>" in msg
    assert "special token ids differ" in check(_teacher_copy(student, tmp_path / "eos", eos=3))
    assert "no config.json there" in check(tmp_path / "nowhere")
    bad = compose(["scoring.scorers=[{cls: tests.unit.scorers.NotAScorer}]"])
    assert "is not a subclass of mrl.scoring.Scorer" in check_scoring(bad, "local")
    assert "cannot import it" in check_scoring(compose(["scoring.scorers=[{cls: tests.unit.nope.X}]"]), "local")
