"""The engine-vs-trainer mismatch split by cause (mrl.megatron.mismatch): per-token lags from the sampling
versions, token-weighted sums per part, the routing part as replay off minus replay on on the same tokens,
the correction weights of the stale tokens, and the trainer's own version across pushes and steps."""

from __future__ import annotations

import math

import pytest
import torch

from mrl.config.schema import AlgoConfig, Correction
from mrl.megatron import mismatch


def k3(d: float) -> float:
    return math.expm1(d) - d


# one micro-batch of two samples, five loss positions each; lag 0 = sampled by the trainer's weights
MASK = torch.tensor([[0, 1, 1, 1, 0], [0, 1, 1, 1, 1]], dtype=torch.float32)
LAG = torch.tensor([[0, 0, 0, 0, 0], [0, 0, 1, 1, 2]], dtype=torch.int32)
BEHAV = torch.full((2, 5), -1.0)
E = 2.0 ** -23  # about 1.2e-7, and -1 + E is exact in float32: the trainer's logprobs are float32
D = torch.tensor([[9.0, E, -2 * E, 0.0, 9.0], [9.0, 4 * E, 0.3, -0.5, 1.0]])  # log pi_train - log pi_engine


def sums(d: torch.Tensor, algo: AlgoConfig | None, replay: bool, mask: torch.Tensor = MASK) -> dict[str, float]:
    lags = mismatch.batch_lags([0, 1, 2], 2)  # versions 0..2 against a trainer at 2: lags 0, 1, 2
    assert lags == [0, 1, 2]
    return mismatch.finish([mismatch.gap_sums(BEHAV + d, BEHAV, mask, LAG, lags, algo)], replay)


NUMERICS = [E, -2 * E, 0.0, 4 * E]  # the lag-0 tokens; masked positions (9.0) never count
STALE = {1: [0.3, -0.5], 2: [1.0]}


def test_parts_are_token_weighted_means_by_lag_with_counts():
    out = mismatch.ratios(sums(D, AlgoConfig(correction=Correction.tis, is_cap=2.0), True), dp=2)
    assert out["mismatch/numerics_tokens"] == 2 * 4  # dp=2: this rank's count stands for each DP rank
    assert out["mismatch/numerics_logprob_diff"] == pytest.approx(sum(map(abs, NUMERICS)) / 4, rel=1e-12)
    assert out["mismatch/numerics_kl"] == pytest.approx(sum(map(k3, NUMERICS)) / 4, rel=1e-9)
    assert 0 < out["mismatch/numerics_kl"] < 1e-13  # float64: a KL far below float32's resolution survives
    # the second sample holds stale tokens too (resumed across a sync): its lag-0 token is counted apart
    assert out["mismatch/numerics_resumed_tokens"] == 2 * 1
    assert out["mismatch/numerics_resumed_kl"] == pytest.approx(k3(4 * E), rel=1e-9)
    flat = STALE[1] + STALE[2]
    assert out["mismatch/stale_tokens"] == 2 * 3
    assert out["mismatch/stale_kl"] == pytest.approx(sum(map(k3, flat)) / 3)
    assert out["mismatch/stale_logprob_diff"] == pytest.approx(sum(map(abs, flat)) / 3)
    assert out["mismatch/stale_lag1_tokens"] == 4 and out["mismatch/stale_lag2_tokens"] == 2
    assert out["mismatch/stale_lag1_kl"] == pytest.approx(sum(map(k3, STALE[1])) / 2)
    assert out["mismatch/stale_lag2_kl"] == pytest.approx(k3(1.0))
    # TIS at cap 2: exp(1.0) = 2.72 is cut to 2, the others keep w = exp(d)
    assert out["mismatch/stale_is_weight_mean"] == pytest.approx((math.exp(0.3) + math.exp(-0.5) + 2.0) / 3)
    assert out["mismatch/stale_is_cut_frac"] == pytest.approx(1 / 3)
    assert "mismatch/routing_kl" not in out  # no replay-off forward of this batch


def test_routing_part_is_replay_off_minus_replay_on_on_the_lag_zero_tokens():
    off = D.clone()
    off[0, 1], off[1, 1], off[1, 3] = 0.05, -0.04, 5.0  # natural routing moves lag-0 tokens (and a stale one)
    out = mismatch.ratios(sums(D, None, True) | sums(off, None, False), dp=1)
    natural = [0.05, -2 * E, 0.0, -0.04]
    assert out["mismatch/routing_kl"] == pytest.approx((sum(map(k3, natural)) - sum(map(k3, NUMERICS))) / 4)
    assert out["mismatch/routing_logprob_diff"] == pytest.approx(
        (sum(map(abs, natural)) - sum(map(abs, NUMERICS))) / 4)
    assert out["mismatch/stale_kl"] == pytest.approx(sum(map(k3, [0.3, -0.5, 1.0])) / 3)  # replay on's


def test_icepop_rejections_and_a_part_without_tokens():
    algo = AlgoConfig(correction=Correction.icepop, icepop_low=0.5, icepop_high=2.0)
    only_stale = MASK * (LAG > 0)
    out = mismatch.ratios(sums(D, algo, True, only_stale), dp=1)
    # a part without tokens has its count only: a mean of nothing is not an exact 0
    assert out["mismatch/numerics_tokens"] == 0 and "mismatch/numerics_kl" not in out
    # exp(0.3) and exp(-0.5) = 0.61 kept; exp(1.0) = 2.72 rejected (weight 0)
    assert out["mismatch/stale_is_cut_frac"] == pytest.approx(1 / 3)
    assert out["mismatch/stale_is_weight_mean"] == pytest.approx((math.exp(0.3) + math.exp(-0.5)) / 3)


def test_replay_off_training_reports_the_lag_zero_part_under_its_own_name():
    out = mismatch.ratios(sums(D, None, False), dp=1)
    assert "mismatch/numerics_kl" not in out and "mismatch/routing_kl" not in out
    assert out["mismatch/numerics_replay_off_kl"] == pytest.approx(sum(map(k3, NUMERICS)) / 4, rel=1e-9)
    assert out["mismatch/stale_tokens"] == 3


def test_other_metrics_pass_through_and_no_versions_means_no_split():
    assert mismatch.ratios({"grad_norm": 1.5}, dp=4) == {"grad_norm": 1.5}
    assert mismatch.split_sums(None, [], [], 3, True, None) == {}
    assert mismatch.split_sums([[1, 2]], [], [], None, True, None) == {}


def test_weights_version_follows_pushes_and_steps():
    v = mismatch.WeightsVersion()
    assert v.current is None  # never told: no split
    v.synced(0)  # the engines start from the trainer's weights as version 0
    assert v.current == 0
    v.stepped(False)  # a skipped update leaves the weights as they were
    assert v.current == 0
    v.stepped(True)  # updated, not pushed yet (weight_sync.every_n_steps > 1): every token is stale
    v.stepped(True)
    assert v.current == 1
    v.synced(1)
    assert v.current == 1


def test_build_batch_ships_each_tokens_version():
    from mrl.config.schema import Config, RolloutConfig
    from mrl.data.prompt import Prompt
    from mrl.rollout.buffer import Group
    from mrl.rollout.sample import Sample
    from mrl.megatron.batch import RLBatch, WholeBatch
    from mrl.trainer.batch import build_batch

    def sample(versions):
        n = len(versions)
        return Sample(prompt_ids=[1, 2], group_id=0, index=0, max_new_tokens=n, response_ids=list(range(3, 3 + n)),
                      response_logprobs=[-1.0] * n, versions=versions, loss_mask=[1] * n)

    groups = [Group(Prompt(id="p", text="x", answer="y"), [sample([4, 4, 5]), sample([5, 5])], [1.0, 0.0])]
    batch, _, _ = build_batch(groups, Config(rollout=RolloutConfig(n_samples_per_prompt=2)), with_routes=False)
    assert batch.versions == [[4, 4, 5], [5, 5]]  # a partial rollout resumed across the v4 -> v5 sync
    assert mismatch.batch_lags(WholeBatch.of(batch).versions, 5) == [0, 1]
    share = RLBatch(tokens=batch.tokens[1:], prompt_lens=batch.prompt_lens[1:], behav_logp=batch.behav_logp[1:],
                    advantages=batch.advantages[1:], routes=None, versions=batch.versions[1:],
                    whole=WholeBatch.of(batch), first=1)
    assert mismatch.batch_lags(WholeBatch.of(share).versions, 5) == [0, 1]  # a share reports the whole batch's lags
