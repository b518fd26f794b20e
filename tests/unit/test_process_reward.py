"""The process reward model's steps and inputs (``mrl.scoring.process_reward``) and the reference engines'
logprobs on their way to the loss (``scoring.reference``: Sample -> RLBatch.ref_logp -> micro-batch -> KL),
by hand; the config and preflight refusals of both. The engines' side: tests/integration/test_process_reward.py
and tests/integration/test_reference_engine.py."""

from __future__ import annotations

import types

import pytest
import torch

from mrl.algo import compute_policy_loss
from mrl.config.load import compose
from mrl.config.schema import Aggregation, AlgoConfig, Correction, KLEstimator
from mrl.data import Prompt
from mrl.models.tiny import build_tokenizer
from mrl.rollout.buffer import Group
from mrl.rollout.sample import Sample
from mrl.scoring.process_reward import prm_input, step_ends
from mrl.trainer.batch import build_batch

P = Prompt(id="p0", text="add 3 4", answer="7")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(512)


def test_steps_end_with_the_separator_and_at_each_model_turn(tok):
    ids = tok.encode("3+4=7\n\nso the answer is 7\n\nok", add_special_tokens=False).ids + [2]
    piece = lambda t: tok.decode([t], skip_special_tokens=False)  # noqa: E731
    ends = step_ends(ids, [(0, len(ids))], piece, "\n\n")
    steps = ["".join(piece(t) for t in ids[a:b]) for a, b in zip([0] + ends, ends)]
    assert steps == ["3+4=7\n\n", "so the answer is 7\n\n", "ok<eos>"]
    assert step_ends(ids, [(0, len(ids))], piece, "") == [len(ids)]  # no separator: the turn is the step
    # a multi-turn episode: each model turn ends a step, observations (between the spans) are never one
    assert step_ends(ids, [(0, 3), (5, 12)], piece, "\n\n") == [3, 7, 12]  # turn 2 starts with "\n\n" (5, 6)
    # a token holding the separator's end with more text: the step ends after that token
    pieces = {1: "a.\n", 2: "\nb", 3: "c"}
    assert step_ends([1, 2, 3], [(0, 3)], pieces.get, "\n\n") == [2, 3]


def test_the_prm_reads_after_each_step_and_its_tag():
    ids, read = prm_input([1, 5], [10, 11, 12, 13, 14], [2, 5], tag=[99])
    assert ids == [1, 5, 10, 11, 99, 12, 13, 14, 99]
    assert read == [5, 9]  # the next-token distributions after each tag: position 5 and the one after the input
    assert prm_input([1], [10, 11], [1, 2], tag=[]) == ([1, 10, 11], [2, 3])


def _sample(i: int, response: list[int], ref: list[float] | None) -> Sample:
    n = len(response)
    return Sample(prompt_ids=[1, 5, 6], group_id=0, index=i, max_new_tokens=8, response_ids=response,
                  response_logprobs=[-1.0] * n, versions=[0] * n, loss_mask=[1] * n, finish_reason="stop",
                  ref_logprobs=ref if ref is not None else [])


def test_reference_logprobs_reach_the_micro_batch_and_the_kl_by_hand():
    from mrl.megatron.policy import Policy

    cfg = compose(["rollout.n_samples_per_prompt=2", "algo.kl_coef=0.1", "scoring=reference",
                   "train.sft_warmup_steps=0"])
    refs = [[-0.5, -2.0], [-1.5, -0.25, -3.0]]
    groups = [Group(P, [_sample(0, [10, 11], refs[0]), _sample(1, [12, 13, 14], refs[1])], [1.0, 0.0], ["", ""])]
    batch, _, _ = build_batch(groups, cfg, with_routes=False)
    assert batch.ref_logp == refs
    fake = types.SimpleNamespace(cfg=cfg, support_spec=None, codec=None)
    mb = Policy._micro_batch(fake, batch, [0, 1], None, 8, False, 1)
    ref, mask = mb.data["ref"].cpu(), mb.data["mask"].cpu()
    p = 3  # position p - 1 predicts the first response token
    for b, row in enumerate(refs):
        assert torch.equal(ref[b, p - 1:p - 1 + len(row)], torch.tensor(row))
        assert ref[b, :p - 1].abs().sum() == 0 and ref[b, p - 1 + len(row):].abs().sum() == 0
    algo = AlgoConfig(correction=Correction.none, aggregation=Aggregation.token_mean, kl_coef=0.1,
                      kl_estimator=KLEstimator.k3)
    logp = torch.full((2, 7), -1.0, dtype=torch.float64)
    _, m = compute_policy_loss(logp, logp, logp, mb.data["adv"].double(), mask.double(), algo,
                               ref_logp=ref.double())
    d = [r + 1.0 for row in refs for r in row]  # log(ref / pi) at each trained token
    want = sum(torch.exp(torch.tensor(x)) - x - 1 for x in d) / len(d)  # k3, token mean
    assert float(m["kl_ref"]) == pytest.approx(float(want), rel=1e-6)
    # a sample without the reference's logprobs is never trained
    groups[0].samples[1].ref_logprobs = []
    with pytest.raises(ValueError, match="sample 1 of group 0 has 0 reference logprobs for 3 response tokens"):
        build_batch(groups, cfg, with_routes=False)
    plain, _, _ = build_batch(groups, compose(["rollout.n_samples_per_prompt=2"]), with_routes=False)
    assert plain.ref_logp is None


@pytest.mark.parametrize("overrides, msg", [
    ([], "is true but algo.kl_coef is 0"),
    (["algo.kl_coef=0.1", "rollout.temperature=0.7"], "an engine's prefill logprobs are at T=1"),
    (["algo.kl_coef=0.1", "train.sampling_mask=true"], "renormalized over each token's sampling support"),
    (["algo.kl_coef=0.1", "train.sft_warmup_steps=5"], "RL does not start from model.hf_path"),
])
def test_reference_on_engines_refuses_what_its_logprobs_cannot_stand_for(overrides, msg):
    base = ["scoring=reference", "train.sft_warmup_steps=0"]
    with pytest.raises(ValueError, match=msg):
        compose(base + overrides)
    cfg = compose(base + ["algo.kl_coef=0.1", "train.sft_warmup_steps=5", "scoring.reference.hf_path=/ref"])
    assert cfg.scoring.reference.hf_path == "/ref"  # a named reference may differ from where RL starts


def test_the_run_builds_the_prm_and_reference_servers_unstarted(tmp_path):
    from mrl.trainer.engines import RunEngines

    cfg = compose([f"run_dir={tmp_path}", "model.hf_path=/policy", "scoring=prm", "scoring.prm.hf_path=/prm",
                   "scoring.reference.enabled=true", "algo.kl_coef=0.1", "train.sft_warmup_steps=0"])
    groups = RunEngines(cfg).side_groups()
    assert sorted(groups) == ["prm", "reference"]
    assert groups["prm"].engines[0].model_path == "/prm" and groups["reference"].engines[0].model_path == "/policy"
    assert not any(e.proc for g in groups.values() for e in g.engines)
    attached = compose(["scoring=prm", "scoring.prm.hf_path=/prm", "scoring.prm.engine.urls=[http://h:1]"])
    assert RunEngines(attached).side_groups() == {}


def test_preflight_refuses_a_prm_with_another_tokenizer_or_a_long_verdict(ckpt_dir, tmp_path):
    from mrl.preflight import check_reward_fn as check_scoring
    from tests.unit.test_scoring import _teacher_copy

    student = ckpt_dir["tiny"]

    def check(prm, *more):
        return check_scoring(compose([f"model.hf_path={student}", "scoring=prm", f"scoring.prm.hf_path={prm}",
                                      *more]), "local")

    same = _teacher_copy(student, tmp_path / "same")
    assert check(same) is None
    assert "must share the policy's tokenizer" in check(_teacher_copy(student, tmp_path / "x", extra_token="<t>"))
    assert "scoring.prm.good_token='good' is 4 tokens" in check(same, "scoring.prm.good_token=good")
    ref = check_scoring(compose([f"model.hf_path={student}", "scoring=reference", "algo.kl_coef=0.1",
                                 "train.sft_warmup_steps=0", f"scoring.reference.hf_path={tmp_path}/none"]), "local")
    assert "scoring.reference.hf_path" in ref and "no config.json there" in ref


def test_token_ids_logprobs_of_a_recorded_reply_parse():
    """A reply of SGLang 0.5.14 (CPU engine, tiny model) to ``token_ids_logprob=[10, 11]``, ``logprob_start_len=3``
    over 9 input tokens and one generated token."""
    from mrl.sglang.protocol import EngineProtocolError, parse_generate_item

    def triples(*rows):
        return [None if r is None else [[lp, i, None] for lp, i in r] for r in rows]

    meta = {"id": "x", "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 9, "weight_version": "0",
            "output_token_logprobs": [[-5.87388801574707, 204, None]], "completion_tokens": 1,
            "input_token_logprobs": [[None, 99, None], [-6.727114677429199, 7, None]],
            "input_token_ids_logprobs": triples(None, [(-6.457690715789795, 10), (-6.206318378448486, 11)],
                                                [(-6.374074935913086, 10), (-6.2595534324646, 11)]),
            "output_token_ids_logprobs": triples([(-6.605319976806641, 10), (-6.3105268478393555, 11)])}
    out = parse_generate_item({"output_ids": [204], "meta_info": meta}, ("http://x", "/generate"))
    assert out.input_token_ids_logprobs == [None, {10: -6.457690715789795, 11: -6.206318378448486},
                                            {10: -6.374074935913086, 11: -6.2595534324646}]
    assert out.output_token_ids_logprobs == [{10: -6.605319976806641, 11: -6.3105268478393555}]
    with pytest.raises(EngineProtocolError, match="a generated position has none"):
        parse_generate_item({"output_ids": [204], "meta_info": meta | {"output_token_ids_logprobs": [None]}},
                            ("http://x", "/generate"))
    with pytest.raises(EngineProtocolError, match="not a log-probability"):
        parse_generate_item({"output_ids": [204], "meta_info": meta | {
            "output_token_ids_logprobs": triples([(0.5, 10), (-1.0, 11)])}}, ("http://x", "/generate"))
