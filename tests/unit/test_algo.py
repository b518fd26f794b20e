"""mrl.algo against hand-computed values: advantages, aggregation, PPO/DAPO/GSPO clip, IS corrections, KL."""

import math

import pytest
import torch

from mrl.algo import (
    aggregate,
    clipped_surrogate,
    compute_advantages,
    compute_policy_loss,
    dynamic_sampling_mask,
    group_advantages,
    importance_correction,
    kl_penalty,
    loss_normalizer,
    overlong_penalty,
    rloo_advantages,
)
from mrl.config.load import compose
from mrl.config.schema import (
    AdvEstimator,
    Aggregation,
    AlgoConfig,
    Correction,
    CorrectionLevel,
    KLEstimator,
    LossType,
    OldLogprobs,
)

LOG_HALF = math.log(0.5)


def _t(x):
    return torch.tensor(x, dtype=torch.float64)


def _close(actual, expected, tol=1e-9):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float64), _t(expected), atol=tol, rtol=0)


def _cfg(**kw):
    base = dict(correction=Correction.none, aggregation=Aggregation.token_mean, max_response_len=4)
    return AlgoConfig(**(base | kw))


def _logps(ratios, old=LOG_HALF):
    """(logp leaf requiring grad, old_logp) with exp(logp - old_logp) = ratios."""
    old_logp = torch.full_like(_t(ratios), old)
    logp = (old_logp + torch.log(_t(ratios))).requires_grad_()
    return logp, old_logp


# ---------------------------------------------------------------- advantages


def test_grpo_advantages_by_hand():
    # group [1,1,1,0]: mean .75, unbiased var (3*.0625 + .5625)/3 = .25, std .5
    # group [0,0,0,4]: mean 1, unbiased var (3 + 9)/3 = 4, std 2; group [2,2,2,2]: std 0 -> 0
    rewards = _t([1, 1, 1, 0, 0, 0, 0, 4, 2, 2, 2, 2])
    adv = group_advantages(rewards, 4, eps=1e-12)  # eps keeps the all-equal group at 0 / eps = 0
    _close(adv, [0.5, 0.5, 0.5, -1.5, -0.5, -0.5, -0.5, 1.5, 0, 0, 0, 0])
    dr = group_advantages(rewards, 4, std_normalize=False)
    _close(dr, [0.25, 0.25, 0.25, -0.75, -1, -1, -1, 3, 0, 0, 0, 0])


def test_grpo_eps_is_added_to_std():
    adv = group_advantages(_t([1, 0]), 2, eps=0.5)  # std = sqrt(.5) -> .5 / (.70710678 + .5)
    _close(adv, [0.5 / (math.sqrt(0.5) + 0.5), -0.5 / (math.sqrt(0.5) + 0.5)])


def test_rloo_advantages_by_hand():
    # [1,1,1,0]: others' means 2/3, 2/3, 2/3, 1; [3,1]: others 1, 3
    _close(rloo_advantages(_t([1, 1, 1, 0]), 4), [1 / 3, 1 / 3, 1 / 3, -1.0])
    _close(rloo_advantages(_t([3, 1]), 2), [2.0, -2.0])


def test_compute_advantages_dispatches_on_config():
    rewards = _t([1, 1, 1, 0])
    _close(compute_advantages(rewards, 4, AlgoConfig(adv_estimator=AdvEstimator.rloo)), [1 / 3, 1 / 3, 1 / 3, -1.0])
    _close(compute_advantages(rewards, 4, AlgoConfig(std_normalize=False)), [0.25, 0.25, 0.25, -0.75])
    _close(compute_advantages(rewards, 4, AlgoConfig(adv_eps=0.0)), [0.5, 0.5, 0.5, -1.5])


def test_advantages_reject_bad_shapes():
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(_t([1, 0, 1]), 2)
    with pytest.raises(ValueError, match="group_size"):
        rloo_advantages(_t([1, 0]), 1)


def test_dynamic_sampling_keeps_groups_with_signal():
    keep, num_dropped = dynamic_sampling_mask(_t([1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0]), 4)
    assert keep.tolist() == [False, True, False] and num_dropped == 2
    keep, num_dropped = dynamic_sampling_mask(torch.tensor([0, 1, 1, 0]), 2)  # int rewards
    assert keep.tolist() == [True, True] and num_dropped == 0


def test_overlong_penalty_by_hand():
    # L_max 20, L_cache 4: free up to 16, then (16 - L) / 4, -1 at 20 and beyond
    pen = overlong_penalty(torch.tensor([10, 16, 17, 18, 19, 20, 21, 100]), max_len=20, buffer_len=4)
    _close(pen, [0, 0, -0.25, -0.5, -0.75, -1, -1, -1])
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        overlong_penalty(torch.tensor([1]), max_len=4, buffer_len=5)


# ---------------------------------------------------------------- aggregation


AGG_LOSS = [[1.0, 2.0, 3.0, math.nan], [4.0, 100.0, math.inf, 100.0], [100.0, 100.0, 100.0, 100.0]]
AGG_MASK = [[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]]  # masked nan/inf/100 must never count; row 3 is empty


@pytest.mark.parametrize(
    "mode,expected",
    [
        (Aggregation.token_mean, (1 + 2 + 3 + 4) / 4),
        (Aggregation.seq_mean_token_mean, (6 / 3 + 4 / 1) / 2),
        (Aggregation.seq_mean_token_sum_norm, (6 / 4 + 4 / 4) / 2),  # max_response_len 4
    ],
)
def test_aggregation_modes_by_hand(mode, expected):
    _close(aggregate(_t(AGG_LOSS), _t(AGG_MASK), mode, max_response_len=4), expected)


def test_aggregation_external_normalizer_and_counts():
    mask = torch.tensor(AGG_MASK, dtype=torch.bool)
    assert loss_normalizer(mask, Aggregation.token_mean).item() == 4
    assert loss_normalizer(mask, Aggregation.seq_mean_token_mean).item() == 2
    _close(aggregate(_t(AGG_LOSS), mask, Aggregation.token_mean, normalizer=8), 10 / 8)
    with pytest.raises(ValueError, match="algo.max_response_len"):
        aggregate(_t(AGG_LOSS), mask, Aggregation.seq_mean_token_sum_norm)


# ---------------------------------------------------------------- PPO clip (GRPO / DAPO)


def test_ppo_clip_dapo_clip_higher_by_hand():
    # clip_low .2, clip_high .28: bounds [.8, 1.28]
    #   r=1.5 A=+1: min(1.5, 1.28) = 1.28 -> loss -1.28, clipped, grad 0
    #   r=0.5 A=-1: min(-.5, -.8) = -.8   -> loss  .8,  clipped, grad 0
    #   r=1.5 A=-1: min(-1.5, -1.28)=-1.5 -> loss 1.5,  grad -A*r = 1.5
    #   r=0.5 A=+1: min(.5, .8) = .5      -> loss -.5,  grad -.5
    #   r=1.1 A=+1: in range              -> loss -1.1, grad -1.1
    ratios, adv = [[1.5, 0.5, 1.5, 0.5, 1.1]], _t([[1.0, -1.0, -1.0, 1.0, 1.0]])
    logp, old_logp = _logps(ratios)
    mask = torch.ones(1, 5)
    cfg = _cfg(loss=LossType.dapo, clip_low=0.2, clip_high=0.28)
    loss, metrics = compute_policy_loss(logp, old_logp, old_logp, adv, mask, cfg)
    _close(loss, (-1.28 + 0.8 + 1.5 - 0.5 - 1.1) / 5)
    loss.backward()
    _close(logp.grad, [[0.0, 0.0, 1.5 / 5, -0.5 / 5, -1.1 / 5]])
    _close(metrics["clip_frac_high"], 1 / 5)
    _close(metrics["clip_frac_low"], 1 / 5)
    _close(metrics["ratio_mean"], (1.5 + 0.5 + 1.5 + 0.5 + 1.1) / 5)
    # approx KL(old || new), k3 per token: r - 1 - log r
    _close(metrics["approx_kl"], sum(r - 1 - math.log(r) for r in ratios[0]) / 5)


def test_ppo_clip_symmetric_grpo_clips_at_1_2():
    loss, _ = clipped_surrogate(torch.log(_t([1.5, 1.1])), _t([1.0, 1.0]), clip_low=0.2, clip_high=0.2)
    _close(loss, [-1.2, -1.1])


def test_dual_clip_caps_negative_advantage_loss():
    # A=-1, c=3: r=4 -> min(4, 3) = 3 (grad 0); r=2 -> 2; r=4 with A=+1 unaffected -> -1.2
    log_ratio = torch.log(_t([4.0, 2.0, 4.0])).requires_grad_()
    adv = _t([-1.0, -1.0, 1.0])
    loss, _ = clipped_surrogate(log_ratio, adv, clip_low=0.2, clip_high=0.2, dual_clip=3.0)
    _close(loss, [3.0, 2.0, -1.2])
    loss.sum().backward()
    _close(log_ratio.grad, [0.0, 2.0, 0.0])  # d(-A r)/d log r = -A r
    no_dual, _ = clipped_surrogate(log_ratio.detach(), adv, clip_low=0.2, clip_high=0.2)
    _close(no_dual, [4.0, 2.0, -1.2])


def test_ratio_one_gives_minus_weighted_mean_advantage():
    logp = torch.full((2, 3), LOG_HALF, dtype=torch.float64, requires_grad=True)
    mask = _t([[1, 1, 0], [1, 0, 0]])
    adv = _t([1.0, -3.0])
    loss, metrics = compute_policy_loss(logp, logp.detach(), logp.detach(), adv, mask, _cfg())
    _close(loss, -(1 + 1 - 3) / 3)
    _close(metrics["ratio_mean"], 1.0)
    _close(metrics["clip_frac_low"], 0.0)
    cfg = _cfg(aggregation=Aggregation.seq_mean_token_mean)
    loss, _ = compute_policy_loss(logp, logp.detach(), logp.detach(), adv, mask, cfg)
    _close(loss, -(1 + -3) / 2)


def test_zero_advantages_give_zero_loss_and_grad():
    logp, old_logp = _logps([[1.3, 0.7, 1.0], [2.0, 0.2, 1.0]])
    loss, _ = compute_policy_loss(logp, old_logp, old_logp, torch.zeros(2), torch.ones(2, 3), _cfg())
    assert loss.item() == 0.0
    loss.backward()
    assert torch.count_nonzero(logp.grad) == 0


@pytest.mark.parametrize("loss_type", [LossType.grpo, LossType.gspo])
@pytest.mark.parametrize("correction", [Correction.none, Correction.tis, Correction.icepop])
def test_masked_tokens_get_exactly_zero_grad(loss_type, correction):
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    logp = torch.tensor([[-0.5, -1.0, -math.inf, -math.inf], [-0.2, -0.1, -2.0, math.nan]],
                        dtype=torch.float64, requires_grad=True)
    old_logp = torch.tensor([[-0.6, -0.9, 0.0, -math.inf], [-0.25, -0.1, -1.9, 7.0]], dtype=torch.float64)
    behav_logp = old_logp - 0.05
    cfg = _cfg(loss=loss_type, correction=correction, kl_coef=0.1)
    adv = _t([[1.0, 1.0, math.nan, math.nan], [-2.0, -2.0, -2.0, math.inf]])  # [B, T], garbage on padding
    loss, metrics = compute_policy_loss(logp, old_logp, behav_logp, adv, mask, cfg,
                                        ref_logp=old_logp + 0.3)
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in metrics.values())
    loss.backward()
    assert torch.all(logp.grad[~mask] == 0.0)
    assert torch.all(logp.grad[mask] != 0.0)


# ---------------------------------------------------------------- GSPO


def test_gspo_sequence_ratio_clip_and_grad_by_hand():
    # seq 0: tokens 0,1 log ratios .2, .4 -> s0 = e^.3 = 1.3499; A0 = +1 -> clipped at 1 + 4e-4, grad 0
    # seq 1: log ratios 6e-4, -4e-4, 1e-4 -> s1 = e^1e-4, inside [1 - 3e-4, 1 + 4e-4]; A1 = 2
    # seq_mean_token_mean over 2 sequences: loss = (-(1.0004) + -2 s1) / 2; grad seq1 token = -2 s1 / 3 / 2
    mask = _t([[1, 1, 0], [1, 1, 1]])
    old_logp = torch.full((2, 3), -1.0, dtype=torch.float64)
    logp = (old_logp + _t([[0.2, 0.4, 5.0], [6e-4, -4e-4, 1e-4]])).requires_grad_()
    cfg = _cfg(loss=LossType.gspo, clip_low=3e-4, clip_high=4e-4, aggregation=Aggregation.seq_mean_token_mean)
    loss, metrics = compute_policy_loss(logp, old_logp, old_logp, _t([1.0, 2.0]), mask, cfg)
    s0, s1 = math.exp(0.3), math.exp(1e-4)
    _close(loss, (-1.0004 - 2 * s1) / 2)
    loss.backward()
    _close(logp.grad, [[0.0, 0.0, 0.0], [-2 * s1 / 6] * 3])
    _close(metrics["clip_frac_high"], 2 / 5)  # token-weighted: seq 0's two tokens
    _close(metrics["ratio_mean"], (2 * s0 + 3 * s1) / 5)
    # token-level PPO with the same clip range clips seq 1's first token (ratio e^6e-4 > 1 + 4e-4): no grad there
    tok_logp = logp.detach().requires_grad_()
    tok_cfg = _cfg(clip_low=3e-4, clip_high=4e-4, aggregation=Aggregation.seq_mean_token_mean)
    compute_policy_loss(tok_logp, old_logp, old_logp, _t([1.0, 2.0]), mask, tok_cfg)[0].backward()
    assert tok_logp.grad[1, 0] == 0.0 and tok_logp.grad[1, 1] != 0.0


def test_gspo_per_token_gradients_are_identical_within_a_sequence():
    # A0 = -1 with s0 = e^.3 > 1 + eps: -min(-s0, -1.0004) = s0, not clipped -> grad s0 / n0 / B per token
    torch.manual_seed(0)
    mask = _t([[1, 1, 0, 0], [1, 1, 1, 1]])
    old_logp = -torch.rand(2, 4, dtype=torch.float64) - 0.1
    logp = (old_logp + _t([[0.1, 0.5, 0.0, 0.0], [0.3, -0.2, 0.05, 0.01]])).requires_grad_()
    cfg = _cfg(loss=LossType.gspo, clip_low=3e-4, clip_high=4e-4, aggregation=Aggregation.seq_mean_token_mean)
    loss, _ = compute_policy_loss(logp, old_logp, old_logp, _t([-1.0, -0.5]), mask, cfg)
    loss.backward()
    s0, s1 = math.exp(0.3), math.exp(0.04)
    _close(logp.grad, [[s0 / 2 / 2] * 2 + [0, 0], [0.5 * s1 / 4 / 2] * 4])


# ---------------------------------------------------------------- the papers' formulas, ratio != 1


def _batch(seed, B=5, T=6):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([6, 2, 4, 5, 3])[:B]
    mask = torch.arange(T)[None, :] < lengths[:, None]
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2 - 0.1
    logp = old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)  # ratios of about e^(+-0.3)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return logp, old, adv, mask


def _ppo_reference(logp, old, adv, mask, eps_low, eps_high, dual=None):
    """PPO-clip (Schulman et al. 2017) with DAPO's decoupled clip range (Yu et al. 2025, eq. 8) and dual-clip
    (Ye et al. 2020, eq. 5), token-mean over the batch, written token by token from the formulas."""
    total, n = 0.0, 0
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if not mask[i, t]:
                continue
            r = torch.exp(logp[i, t] - old[i, t])
            a = adv[i]
            obj = torch.minimum(r * a, torch.clamp(r, 1 - eps_low, 1 + eps_high) * a)
            if dual is not None and a < 0:
                obj = torch.maximum(obj, dual * a)
            total, n = total - obj, n + 1
    return total / n


def _gspo_reference(logp, old, adv, mask, eps_low, eps_high):
    """GSPO (Zheng et al. 2025, eqs. 5-7): s_i = (pi(y_i) / pi_old(y_i))^(1 / |y_i|), J = mean_i
    min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i); its gradient through s_i (eq. 10)."""
    total = 0.0
    for i in range(logp.shape[0]):
        m = mask[i]
        s_i = torch.exp((logp[i][m] - old[i][m]).sum() / m.sum())
        total = total - torch.minimum(s_i * adv[i], torch.clamp(s_i, 1 - eps_low, 1 + eps_high) * adv[i])
    return total / logp.shape[0]


@pytest.mark.parametrize("clip,dual", [((0.2, 0.2), None), ((0.2, 0.28), None), ((0.1, 0.15), 1.5)])
def test_ppo_and_dapo_clip_against_the_paper_formula(clip, dual):
    logp0, old, adv, mask = _batch(3)
    ref_logp = logp0.clone().requires_grad_()
    want = _ppo_reference(ref_logp, old, adv, mask, *clip, dual)
    want.backward()
    logp = logp0.clone().requires_grad_()
    cfg = _cfg(loss=LossType.dapo, clip_low=clip[0], clip_high=clip[1], dual_clip=dual)
    got, metrics = compute_policy_loss(logp, old, old, adv, mask, cfg)
    got.backward()
    _close(got, want.item(), tol=1e-12)
    torch.testing.assert_close(logp.grad, torch.where(mask, ref_logp.grad, 0), atol=1e-12, rtol=0)
    r = torch.exp(logp0 - old)
    assert 0 < metrics["clip_frac_high"] and 0 < metrics["clip_frac_low"]  # ratio != 1: the clip acts
    # where it acts the gradient is zero; the unclipped loss (clip range wide open) differs
    clipped = mask & (((r > 1 + clip[1]) & (adv[:, None] > 0)) | ((r < 1 - clip[0]) & (adv[:, None] < 0)))
    assert clipped.any() and torch.all(logp.grad[clipped] == 0)
    wide = logp0.clone().requires_grad_()
    compute_policy_loss(wide, old, old, adv, mask, _cfg(clip_low=0.99, clip_high=100.0))[0].backward()
    assert not torch.allclose(wide.grad, logp.grad)


def test_gspo_loss_and_gradient_against_the_paper_formula():
    logp0, old, adv, mask = _batch(7)
    ref_logp = logp0.clone().requires_grad_()
    want = _gspo_reference(ref_logp, old, adv, mask, 0.03, 0.04)
    want.backward()
    logp = logp0.clone().requires_grad_()
    cfg = _cfg(loss=LossType.gspo, clip_low=0.03, clip_high=0.04, aggregation=Aggregation.seq_mean_token_mean)
    got, metrics = compute_policy_loss(logp, old, old, adv, mask, cfg)
    got.backward()
    _close(got, want.item(), tol=1e-12)
    torch.testing.assert_close(logp.grad, torch.where(mask, ref_logp.grad, 0), atol=1e-12, rtol=0)
    assert metrics["clip_frac_high"] + metrics["clip_frac_low"] > 0
    # with ratio != 1 GSPO's sequence clip gives another gradient than GRPO's token clip (at ratio 1 they agree)
    grpo = logp0.clone().requires_grad_()
    compute_policy_loss(grpo, old, old, adv, mask, _cfg(loss=LossType.grpo, clip_low=0.03, clip_high=0.04,
                                                        aggregation=Aggregation.seq_mean_token_mean))[0].backward()
    assert not torch.allclose(grpo.grad, logp.grad)
    at_one = [old.clone().requires_grad_() for _ in range(2)]
    for x, loss in zip(at_one, (LossType.gspo, LossType.grpo)):
        compute_policy_loss(x, old, old, adv, mask, _cfg(loss=loss, clip_low=0.03, clip_high=0.04,
                                                         aggregation=Aggregation.seq_mean_token_mean))[0].backward()
    torch.testing.assert_close(at_one[0].grad, at_one[1].grad, atol=1e-12, rtol=0)


def test_decoupled_ppo_clips_against_the_proximal_policy_and_weighs_by_the_behaviour_one():
    """AReaL (Fu et al. 2025, eq. 5): -min(r A, clip(r) A) * min(pi_prox / pi_behav, C), r = pi / pi_prox."""
    logp0, prox, adv, mask = _batch(5)
    behav = prox + 0.5 * torch.randn(prox.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    logp = logp0.clone().requires_grad_()
    got, _ = compute_policy_loss(logp, prox, behav, adv, mask, _cfg(correction=Correction.tis, is_cap=1.5))
    r = torch.exp(logp0 - prox)
    w = torch.exp(prox - behav).clamp(max=1.5)
    per_tok = -torch.minimum(r * adv[:, None], r.clamp(0.8, 1.2) * adv[:, None]) * w
    _close(got, (torch.where(mask, per_tok, 0).sum() / mask.sum()).item(), tol=1e-12)


# ---------------------------------------------------------------- micro-batches


@pytest.mark.parametrize("aggregation", list(Aggregation))
@pytest.mark.parametrize("loss_type,correction", [(LossType.grpo, Correction.tis), (LossType.gspo, Correction.mis),
                                                  (LossType.dapo, Correction.icepop)])
def test_micro_batches_sum_to_full_batch(aggregation, loss_type, correction):
    torch.manual_seed(1)
    B, T = 6, 5
    lengths = torch.tensor([5, 1, 3, 4, 2, 5])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    old_logp = -torch.rand(B, T, dtype=torch.float64) * 2
    logp0 = old_logp + 0.3 * torch.randn(B, T, dtype=torch.float64)
    behav_logp = old_logp + 0.4 * torch.randn(B, T, dtype=torch.float64)
    ref_logp = old_logp + 0.2 * torch.randn(B, T, dtype=torch.float64)
    adv = torch.randn(B, dtype=torch.float64)
    level = CorrectionLevel.sequence_product if correction is Correction.mis else CorrectionLevel.token
    cfg = _cfg(loss=loss_type, correction=correction, aggregation=aggregation, max_response_len=T, kl_coef=0.05,
               correction_level=level, mis_high=1.5)

    logp = logp0.clone().requires_grad_()
    full, _ = compute_policy_loss(logp, old_logp, behav_logp, adv, mask, cfg, ref_logp=ref_logp)
    full.backward()

    logp_mb = logp0.clone().requires_grad_()
    splits = [slice(0, 2), slice(2, 3), slice(3, 6)]
    # sequences masked IS rejects leave the normalizer: the trainer counts them out before the loss
    normalizer = sum(loss_normalizer(importance_correction(old_logp[s], behav_logp[s], mask[s], cfg).counted,
                                     aggregation) for s in splits)
    total = 0.0
    for s in splits:
        part, _ = compute_policy_loss(logp_mb[s], old_logp[s], behav_logp[s], adv[s], mask[s], cfg,
                                      ref_logp=ref_logp[s], normalizer=normalizer)
        part.backward()
        total = total + part.detach()
    torch.testing.assert_close(total, full.detach(), atol=1e-12, rtol=0)
    torch.testing.assert_close(logp_mb.grad, logp.grad, atol=1e-12, rtol=0)
    # and without the global normalizer the micro-batch sum is not the full loss
    local = sum(compute_policy_loss(logp0[s], old_logp[s], behav_logp[s], adv[s], mask[s], cfg,
                                    ref_logp=ref_logp[s])[0] for s in splits)
    assert not torch.isclose(local, full.detach())


# ---------------------------------------------------------------- off-policy correction


W_TOKENS = [0.25, 0.8, 1.0, 1.5, 3.0, 50.0]  # the last token is masked out
W_MASK = torch.tensor([[1, 1, 1, 1, 1, 0]], dtype=torch.bool)


def _correct(cfg, w=W_TOKENS, mask=W_MASK):
    behav_logp = torch.full(mask.shape, -1.0, dtype=torch.float64)
    old_logp = behav_logp + torch.log(_t(w)).view(mask.shape)
    return importance_correction(old_logp, behav_logp, mask, cfg)


def test_tis_truncates_weights():
    c = _correct(_cfg(correction=Correction.tis, is_cap=2.0))
    _close(c.weight, [[0.25, 0.8, 1.0, 1.5, 2.0, 0.0]])
    assert c.keep.tolist() == W_MASK.tolist()
    _close(c.metrics["is_clip_frac"], 1 / 5)
    _close(c.metrics["is_weight_mean"], (0.25 + 0.8 + 1 + 1.5 + 3) / 5)
    _close(c.metrics["is_weight_max"], 3.0)  # the masked 50 is ignored
    _close(c.metrics["mismatch_kl"], sum(w - 1 - math.log(w) for w in W_TOKENS[:5]) / 5)


def test_icepop_masks_tokens_outside_its_band():
    c = _correct(_cfg(correction=Correction.icepop, icepop_low=0.5, icepop_high=2.0))
    _close(c.weight, [[0.0, 0.8, 1.0, 1.5, 0.0, 0.0]])
    _close(c.metrics["is_masked_frac"], 2 / 5)
    assert c.counted.tolist() == W_MASK.tolist()  # masked tokens still count in the normalizer


def test_sequence_weights_product_and_geometric_mean():
    # row 0: w = 2, 1 -> product 2, geometric mean sqrt(2); row 1: w = 4, 4, (masked 100) -> 16 and 4
    w = [[2.0, 1.0, 7.0], [4.0, 4.0, 100.0]]
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    geo = _correct(_cfg(correction=Correction.tis, is_cap=5.0, correction_level=CorrectionLevel.sequence_geomean),
                   w, mask)
    _close(geo.weight, [[math.sqrt(2), math.sqrt(2), 0.0], [4.0, 4.0, 0.0]])
    prod = _correct(_cfg(correction=Correction.tis, is_cap=5.0, correction_level=CorrectionLevel.sequence_product),
                    w, mask)
    _close(prod.weight, [[2.0, 2.0, 0.0], [5.0, 5.0, 0.0]])  # 16 truncated at the cap
    _close(prod.metrics["is_clip_frac"], 2 / 4)


def test_masked_is_rejects_sequences_above_the_threshold_out_of_the_normalizer():
    # Liu et al. 2025 (MIS): rho = prod_t w_t; rho > C drops the sequence from the gradient and the normalizer.
    # row 0: rho = .5 * 3 = 1.5 <= 2 kept; row 1: rho = 1.5 * 1.5 = 2.25 > 2 rejected although each token < 2;
    # row 2: rho = .1 (small weights are kept: the threshold is an upper one)
    w = [[0.5, 3.0, 1.0], [1.5, 1.5, 1.0], [0.1, 1.0, 1.0]]
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    cfg = _cfg(correction=Correction.mis, mis_high=2.0, correction_level=CorrectionLevel.sequence_product)
    c = _correct(cfg, w, mask)
    _close(c.weight, [[1.5, 1.5, 0.0], [0.0, 0.0, 0.0], [0.1, 0.0, 0.0]])
    assert c.counted.tolist() == [[True, True, False], [False, False, False], [True, False, False]]
    _close(c.metrics["is_masked_tokens"], 2)
    # the loss at ratio 1 (A = 1): token mean over the kept sequences' tokens only: -(2 * 1.5 + .1) / 3
    behav = torch.full(mask.shape, -1.0, dtype=torch.float64)
    old = behav + torch.log(_t(w))
    logp = old.clone().requires_grad_()
    loss, _ = compute_policy_loss(logp, old, behav, _t([1.0, 1.0, 1.0]), mask, cfg)
    _close(loss, -(2 * 1.5 + 0.1) / 3)
    loss.backward()
    _close(logp.grad, [[-1.5 / 3, -1.5 / 3, 0.0], [0.0, 0.0, 0.0], [-0.1 / 3, 0.0, 0.0]])
    # per-sequence mean: 2 sequences remain
    seq, _ = compute_policy_loss(old, old, behav, _t([1.0, 1.0, 1.0]), mask,
                                 _cfg(correction=Correction.mis, correction_level=CorrectionLevel.sequence_product,
                                      aggregation=Aggregation.seq_mean_token_mean))
    _close(seq, -(1.5 + 0.1) / 2)
    # the geometric mean variant judges row 1 by sqrt(2.25) = 1.5: kept
    geo = _correct(_cfg(correction=Correction.mis, correction_level=CorrectionLevel.sequence_geomean), w, mask)
    assert geo.counted[1].tolist() == [True, True, False]


def test_correction_weights_loss_and_icepop_zeroes_grad():
    # ratio 1 (logp == old_logp): per-token loss -A = -1; icepop weights [0, .8, 1, 1.5, 0]
    old_logp = torch.full((1, 6), -1.0, dtype=torch.float64)
    behav_logp = old_logp - torch.log(_t([W_TOKENS]))
    logp = old_logp.clone().requires_grad_()
    cfg = _cfg(correction=Correction.icepop)
    loss, metrics = compute_policy_loss(logp, old_logp, behav_logp, _t([1.0]), W_MASK, cfg)
    _close(loss, -(0.8 + 1.0 + 1.5) / 5)  # rejected tokens still count in the token normalizer
    loss.backward()
    _close(logp.grad, [[0.0, -0.8 / 5, -1.0 / 5, -1.5 / 5, 0.0, 0.0]])
    _close(metrics["is_masked_frac"], 2 / 5)
    loss, _ = compute_policy_loss(logp.detach(), old_logp, behav_logp, _t([1.0]), W_MASK,
                                  _cfg(correction=Correction.tis))
    _close(loss, -(0.25 + 0.8 + 1.0 + 1.5 + 2.0) / 5)


def test_correction_weights_are_detached():
    old_logp = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    c = importance_correction(old_logp, torch.full((1, 2), -0.1, dtype=torch.float64), torch.ones(1, 2),
                              _cfg(correction=Correction.tis))
    assert not c.weight.requires_grad


# ---------------------------------------------------------------- KL


def test_kl_estimators_by_hand():
    # pi = .5, pi_ref = .25: log_r = log(pi_ref/pi) = -log 2
    logp, ref = _t([math.log(0.5), math.log(0.3)]), _t([math.log(0.25), math.log(0.3)])
    ln2 = math.log(2)
    _close(kl_penalty(logp, ref, KLEstimator.k1), [ln2, 0.0])
    _close(kl_penalty(logp, ref, KLEstimator.k2), [0.5 * ln2**2, 0.0])
    _close(kl_penalty(logp, ref, KLEstimator.k3), [0.5 - 1 + ln2, 0.0])


def test_kl_term_is_added_with_its_coefficient():
    # A = 0 and ratio 1: loss = kl_coef * token mean of k1 = .1 * (log(.5/.25) + 0 + log(.8/.9)) / 3
    logp = _t([[math.log(0.5), math.log(0.3), math.log(0.8)]]).requires_grad_()
    ref = _t([[math.log(0.25), math.log(0.3), math.log(0.9)]])
    cfg = _cfg(kl_coef=0.1, kl_estimator=KLEstimator.k1)
    loss, metrics = compute_policy_loss(logp, logp.detach(), logp.detach(), torch.zeros(1), torch.ones(1, 3), cfg,
                                        ref_logp=ref)
    k1 = [math.log(0.5 / 0.25), 0.0, math.log(0.8 / 0.9)]
    _close(loss, 0.1 * sum(k1) / 3)
    _close(metrics["kl_ref"], sum(k1) / 3)
    loss.backward()
    _close(logp.grad, [[0.1 / 3] * 3])  # d k1 / d logp = 1
    with pytest.raises(ValueError, match=r"algo\.kl_coef"):
        compute_policy_loss(logp, logp.detach(), logp.detach(), torch.zeros(1), torch.ones(1, 3), cfg)


def test_metrics_are_detached_scalars():
    logp, old_logp = _logps([[1.2, 0.9]])
    _, metrics = compute_policy_loss(logp, old_logp, old_logp - 0.1, _t([1.0]), torch.ones(1, 2),
                                     _cfg(correction=Correction.tis, dual_clip=3.0))
    assert {"pg_loss", "ratio_mean", "clip_frac_low", "clip_frac_high", "approx_kl", "dual_clip_frac",
            "is_weight_mean", "is_weight_max", "is_clip_frac", "mismatch_kl"} <= set(metrics)
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())


# ---------------------------------------------------------------- config


def test_presets_compose():
    grpo = compose(["algo=grpo"]).algo
    assert (grpo.loss, grpo.clip_low, grpo.clip_high) == (LossType.grpo, 0.2, 0.2)
    assert grpo.aggregation is Aggregation.seq_mean_token_mean and not grpo.dynamic_sampling
    dapo = compose(["algo=dapo", "rollout.max_new_tokens=64"]).algo
    assert (dapo.loss, dapo.clip_low, dapo.clip_high) == (LossType.dapo, 0.2, 0.28)
    assert dapo.aggregation is Aggregation.token_mean and dapo.dynamic_sampling and dapo.overlong_shaping
    assert dapo.max_response_len == 64  # interpolated from rollout.max_new_tokens
    gspo = compose(["algo=gspo"]).algo
    assert (gspo.loss, gspo.clip_low, gspo.clip_high) == (LossType.gspo, 3e-4, 4e-4)
    assert gspo.correction_level is CorrectionLevel.sequence_geomean
    assert compose().algo == grpo


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(clip_low=1.0), r"algo\.clip_low"),
        (dict(clip_high=0.0), r"algo\.clip_high"),
        (dict(dual_clip=1.0), r"algo\.dual_clip"),
        (dict(icepop_low=1.2), r"algo\.icepop_low/icepop_high"),
        (dict(mis_high=0.9), r"algo\.mis_high"),
        (dict(correction=Correction.icepop, correction_level=CorrectionLevel.sequence_product),
         r"algo\.correction_level"),
        (dict(correction=Correction.mis), r"algo\.correction_level.*sequence_product"),
        (dict(mini_batches=0), r"algo\.mini_batches"),
        (dict(ppo_epochs=0), r"algo\.ppo_epochs"),
        (dict(old_logprob_micro_batch_size=0), r"algo\.old_logprob_micro_batch_size: must be >= 1"),
        (dict(old_logprobs=OldLogprobs.engine, correction=Correction.none, old_logprob_micro_batch_size=4),
         r"algo\.old_logprob_micro_batch_size: sizes the pi_old pass"),
        (dict(old_logprobs=OldLogprobs.engine, correction=Correction.tis), r"algo\.correction: tis.*old_logprobs"),
        (dict(kl_coef=-0.1), r"algo\.kl_coef"),
        (dict(aggregation=Aggregation.seq_mean_token_sum_norm), r"algo\.max_response_len"),
        (dict(overlong_shaping=True, max_response_len=4, overlong_buffer_len=8), r"algo\.overlong_buffer_len"),
        (dict(lr=0.0), r"algo\.lr"),
    ],
)
def test_config_validation_names_field(kw, field):
    with pytest.raises(ValueError, match=field):
        AlgoConfig(**kw)


def test_config_validation_through_compose():
    with pytest.raises(ValueError, match=r"algo\.overlong_buffer_len"):
        compose(["algo=dapo", "rollout.max_new_tokens=4"])

