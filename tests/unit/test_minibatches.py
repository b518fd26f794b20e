"""Several optimizer steps per rollout batch (``algo.mini_batches``, ``algo.ppo_epochs``) in ``Policy.rl_step`` on
the tiny model (real megatron, one gloo rank, replayed routes): one mini-batch and one epoch is the single step
as it was (pi_old = the step's own detached logprobs), bit for bit; each mini-batch trains on its own samples
with their routes; pi_old comes from the weights before the first step, so the ratio moves off 1 on later
steps and the clip acts there (and GSPO's sequence clip then gives another update than GRPO's token clip);
the micro-batch size does not change a mini-batch's update, nor the pi_old pass's own micro-batch size
(``algo.old_logprob_micro_batch_size``); masked IS rejects sequences before the loss.
DP shares, TP, EP and PP run in tests/distributed/test_batch_scatter.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.conftest import one_rank_gloo_world
from tests.jobs.resume_check import synthetic_batch

N = 8


@pytest.fixture
def gloo_world():
    with one_rank_gloo_world():
        yield


def _policy(hf, *overrides):
    from mrl.config.load import compose
    from mrl.megatron.parallel import init_parallel
    from mrl.megatron.policy import Policy

    cfg = compose([f"model.hf_path={hf}", "algo.lr=1e-2", "train.micro_batch_size=2", *overrides])
    return Policy(cfg, init_parallel(cfg.parallel, seed=cfg.seed), hf)


def _batch(policy, step=0, n=N):
    c = policy.codec
    return synthetic_batch(step, n, policy.bridge.vocab_size, len(c.moe_layers), c.top_k, c.num_experts)


def _tokens(batch) -> float:
    return float(sum(len(t) - p for t, p in zip(batch.tokens, batch.prompt_lens)))


def _norm(policy, batch) -> float:
    """The batch's loss normalizer as the loop's ``build_batch`` makes it: tokens or sequences."""
    from mrl.config.schema import Aggregation

    return _tokens(batch) if policy.cfg.algo.aggregation is Aggregation.token_mean else float(len(batch))


def _params(policy) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in policy.module.parameters()]).clone()


def _part(batch, lo, hi):
    return dataclasses.replace(batch, **{f: getattr(batch, f)[lo:hi] for f in
                                         ("tokens", "prompt_lens", "behav_logp", "advantages", "routes")})


def test_one_mini_batch_and_one_epoch_is_the_single_step(ckpt_dir, gloo_world):
    """The step as it was before mini-batches, written out here: one forward-backward whose loss takes the
    forward's own detached logprobs as pi_old, one optimizer step."""
    from mrl.algo import compute_policy_loss
    from mrl.megatron import compat
    from mrl.megatron.train_step import forward_backward

    hf = ckpt_dir["tiny"]
    policy = _policy(hf, "algo=dapo", "rollout.max_new_tokens=8")
    batch = _batch(policy)
    norm = torch.full((), _tokens(batch), dtype=torch.float32, device=compat.DEVICE)
    mbs, _ = policy.micro_batches(batch, True, None)

    def loss_fn(lp, mb):
        d = mb.data
        return compute_policy_loss(lp, lp.detach(), d["behav"], d["adv"], d["mask"], policy.cfg.algo,
                                   normalizer=norm)

    policy.model.zero_grad_buffer()
    policy.optimizer.zero_grad()
    outs = forward_backward(policy.model, policy.layout, mbs, vocab_size=policy.bridge.vocab_size, loss_fn=loss_fn,
                            driver=policy.replay, temperature=policy.temperature)
    assert policy.optimizer.step()[0]
    want = _params(policy)

    fresh = _policy(hf, "algo=dapo", "rollout.max_new_tokens=8")
    m = fresh.rl_step(batch, _norm(policy, batch))
    assert torch.equal(_params(fresh), want)
    assert m["pg_loss"] == pytest.approx(sum(float(o["pg_loss"]) for o in outs) / len(outs), rel=1e-12)
    assert m["ratio_mean"] == 1.0 and m["clip_frac_high"] == 0.0 and not any(k.startswith("minibatch/") for k in m)


@pytest.mark.parametrize("packing", ["true", "false"])
def test_each_mini_batch_trains_on_its_own_samples_and_routes(ckpt_dir, gloo_world, packing):
    """With pi_old = the engine's logprobs (nothing recomputed) two mini-batches are two single steps, one on
    each half of every DP share: samples, routes (replayed, random here, so a misplaced one changes the
    update), advantages and normalizers go along."""
    hf = ckpt_dir["tiny"]
    setting = ("algo.old_logprobs=engine", "algo.correction=none", f"train.packing={packing}")
    policy = _policy(hf, *setting, "algo.mini_batches=2")
    batch = _batch(policy)
    m = policy.rl_step(batch, _norm(policy, batch))
    assert {"minibatch/0/clip_frac_high", "minibatch/1/clip_frac_high"} <= m.keys()

    two = _policy(hf, *setting)
    for half in (_part(batch, 0, N // 2), _part(batch, N // 2, N)):
        two.rl_step(half, _norm(two, half))
    torch.testing.assert_close(_params(policy), _params(two), rtol=0, atol=1e-6)
    other = _policy(hf, *setting, "algo.mini_batches=2")  # other routes for the same samples: another update
    rerouted = dataclasses.replace(batch, routes=_batch(policy, step=0).routes[::-1])
    rerouted.routes = [r if len(r) == len(b) else b for r, b in zip(rerouted.routes, batch.routes)]
    assert any(r is not b for r, b in zip(rerouted.routes, batch.routes))
    other.rl_step(rerouted, _norm(other, batch))
    assert (_params(other) - _params(policy)).abs().max() > 1e-5


def test_the_clip_acts_against_the_policy_before_the_first_step(ckpt_dir, gloo_world):
    hf = ckpt_dir["tiny"]
    policy = _policy(hf, "algo=dapo", "rollout.max_new_tokens=8", "algo.mini_batches=2", "algo.ppo_epochs=2")
    batch = _batch(policy)
    m = policy.rl_step(batch, _norm(policy, batch))
    # step 0 trains on its own forward (ratio exactly 1); steps 2 and 3 revisit mini-batches whose pi_old was
    # taken before step 0, after two and three updates
    assert m["minibatch/0/ratio_mean"] == 1.0 and m["minibatch/0/clip_frac_high"] == 0.0
    assert m["minibatch/1/approx_kl"] > 0 and m["minibatch/2/approx_kl"] > 0
    assert max(m[f"minibatch/{j}/clip_frac_high"] + m[f"minibatch/{j}/clip_frac_low"] for j in (1, 2, 3)) > 0, m
    assert m["update_ok"] == 1.0 and m["grad_norm"] > 0


def test_gspo_and_grpo_part_after_the_first_mini_batch(ckpt_dir, gloo_world):
    """At ratio 1 GSPO's sequence ratio and GRPO's token ratio give one gradient; from the second mini-batch
    on the ratio is not 1 and the two clips give different updates."""
    hf = ckpt_dir["tiny"]
    common = ("algo.clip_low=3e-4", "algo.clip_high=4e-4", "algo.correction=none")
    got = {}
    for mini in (1, 2):
        for loss in ("grpo", "gspo"):
            policy = _policy(hf, f"algo.loss={loss}", *common, f"algo.mini_batches={mini}")
            batch = _batch(policy)
            m = policy.rl_step(batch, _norm(policy, batch))
            got[mini, loss] = (_params(policy), m)
    torch.testing.assert_close(got[1, "gspo"][0], got[1, "grpo"][0], rtol=0, atol=1e-6)
    assert (got[2, "gspo"][0] - got[2, "grpo"][0]).abs().max() > 1e-4
    assert got[2, "gspo"][1]["minibatch/1/clip_frac_high"] != got[2, "grpo"][1]["minibatch/1/clip_frac_high"]


def test_the_micro_batch_size_does_not_change_a_mini_batch_update(ckpt_dir, gloo_world):
    hf = ckpt_dir["tiny"]
    out = []
    for size in (1, 4):
        policy = _policy(hf, "algo.mini_batches=2", "train.packing=false", f"train.micro_batch_size={size}")
        batch = _batch(policy)
        m = policy.rl_step(batch, _norm(policy, batch))
        out.append((m, _params(policy)))
    # the gradient (its norm: Adam's update hides a scale) and the update, up to rounding that Adam's
    # normalisation amplifies in near-zero gradient entries
    assert out[0][0]["grad_norm"] == pytest.approx(out[1][0]["grad_norm"], rel=1e-5)
    torch.testing.assert_close(out[0][1], out[1][1], rtol=0, atol=5e-4)


def test_masked_is_rejects_sequences_before_the_loss(ckpt_dir, gloo_world):
    """correction=mis: the old-logprob pass decides which sequences the product ratio rejects, so each
    mini-batch's normalizer leaves them out; the step is the step on the kept sequences alone."""
    hf = ckpt_dir["tiny"]
    setting = ("algo.correction=mis", "algo.correction_level=sequence_product", "algo.mis_high=2.0",
               "algo.aggregation=token_mean")
    policy = _policy(hf, *setting)
    batch = _batch(policy)
    # the behaviour logprobs: the trainer's own, shifted down on some sequences
    mbs, _ = policy.micro_batches(batch, True, None)
    from mrl.megatron.train_step import forward_backward

    outs = forward_backward(policy.model, policy.layout, mbs, vocab_size=policy.bridge.vocab_size,
                            forward_only=True, driver=policy.replay)
    own = {}
    for mb, o in zip(mbs, outs):
        for row, i in enumerate(mb.samples):
            p, n = batch.prompt_lens[i], len(batch.tokens[i])
            own[i] = o["logprobs"][row, p - 1:n - 1].tolist()
    rejected = {1, 4, 6}  # pi_engine well below pi_old on these: rho = pi_old / pi_engine >> 2
    behav = [[x - (1.0 if i in rejected else 0.0) for x in own[i]] for i in range(N)]
    m = policy.rl_step(dataclasses.replace(batch, behav_logp=behav), _norm(policy, batch))
    assert m["is_masked_tokens"] > 0

    kept = [i for i in range(N) if i not in rejected]
    alone = _policy(hf, *setting)
    sub = dataclasses.replace(batch, **{f: [getattr(batch, f)[i] for i in kept] for f in
                                        ("tokens", "prompt_lens", "advantages", "routes")},
                              behav_logp=[behav[i] for i in kept])
    m_alone = alone.rl_step(sub, _norm(alone, sub))
    assert m["grad_norm"] == pytest.approx(m_alone["grad_norm"], rel=1e-5)
    torch.testing.assert_close(_params(policy), _params(alone), rtol=0, atol=5e-4)
    # the same batch without the rejection (behaviour = the trainer's own everywhere) is another step
    plain = _policy(hf, *setting)
    assert plain.rl_step(dataclasses.replace(batch, behav_logp=[own[i] for i in range(N)]),
                         _norm(plain, batch))["grad_norm"] != pytest.approx(m["grad_norm"], rel=1e-3)


@pytest.mark.parametrize("setting", [
    ("train.packing=false",),
    ("train.packing=true",),
    ("train.packing=false", "algo.correction=mis", "algo.correction_level=sequence_product", "algo.mis_high=2.0",
     "algo.aggregation=token_mean"),
], ids=["padded", "packed", "masked_is"])
def test_the_old_logprob_pass_in_micro_batches_of_its_own(ckpt_dir, gloo_world, monkeypatch, setting):
    """``algo.old_logprob_micro_batch_size``: the pi_old pass runs in micro-batches of that size (seen in the
    forward-only calls' shapes), its outputs re-cut to the training micro-batches' rows, and the step is the
    step without it: pi_old per mini-batch (the ratios and clip fractions of the later steps), the engine gap
    from pi_old, the masked sequences, the update."""
    from mrl.megatron import minibatch

    hf = ckpt_dir["tiny"]
    real = minibatch.forward_backward
    common = ("algo=dapo", "rollout.max_new_tokens=8", "algo.mini_batches=2", "algo.ppo_epochs=2",
              "train.micro_batch_size=1", *setting)
    got = {}
    for size in (None, 4):
        shapes = []

        def recording(model, layout, mbs, **kw):
            shapes.extend(tuple(mb.input_ids.shape) for mb in mbs if kw.get("forward_only"))
            return real(model, layout, mbs, **kw)

        monkeypatch.setattr(minibatch, "forward_backward", recording)
        policy = _policy(hf, *common, *([f"algo.old_logprob_micro_batch_size={size}"] if size else []))
        batch = _batch(policy)
        # pi_engine far below pi_old on some sequences: masked IS rejects them
        batch.behav_logp = [[x - (20.0 if i in (1, 6) else 0.0) for x in b] for i, b in enumerate(batch.behav_logp)]
        m = policy.rl_step(batch, _norm(policy, batch))
        got[size] = (m, _params(policy), shapes)
    (m1, p1, s1), (m4, p4, s4) = got[None], got[4]
    assert s1 and {s[0] for s in s1} == {1}
    assert s4 and max(s[0] for s in s4) > 1 and len(s4) < len(s1)
    for k in ("minibatch/1/ratio_mean", "minibatch/3/ratio_mean", "minibatch/3/approx_kl", "logprob_diff_replay_on",
              "grad_norm"):
        assert m4[k] == pytest.approx(m1[k], rel=1e-5, abs=1e-7), k
    assert m4["minibatch/3/approx_kl"] > 0
    if "algo.correction=mis" in setting:
        assert m1["is_masked_tokens"] > 0 and m4["is_masked_tokens"] == m1["is_masked_tokens"]
    torch.testing.assert_close(p4, p1, rtol=0, atol=5e-4)
