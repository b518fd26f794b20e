"""Keep Routing through TE's fused router kernels (``mrl.routing.fused_replay``) against megatron's own
replay path. TE's kernels need CUDA; without them (``kernels="unfused"``) they are replaced by megatron's
unfused functions of the same contract (``topk_routing_with_score_function`` and
``compute_routing_scores_for_aux_loss`` with ``fused=False``), so what is checked is the path's own math:
the masking, the gather for pre-softmax scores, the ids taken from megatron's ``RouterReplay`` queues, and
the spec that plugs the router in. On a GPU host with Transformer Engine the router tests also run with
TE's own kernels (``kernels="te"``)."""

import pytest
import torch

from mrl.megatron import compat  # noqa: F401  (megatron's CPU paths, before megatron is imported)
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
from mrl.routing import fused_replay
from mrl.routing.fused_replay import FusedReplayRouter
from mrl.routing.replay import ReplayError
from tests.conftest import one_rank_gloo_world
from tests.jobs.fused_replay_check import ACTIONS, CASES, DEVICE, E, H, K, PG, compare, pair


def _unfused_topk(*, logits, topk, use_pre_softmax, num_groups, group_topk, scaling_factor, score_function,
                  expert_bias):
    return moe_utils.topk_routing_with_score_function(
        logits, topk, use_pre_softmax=use_pre_softmax, num_groups=num_groups, group_topk=group_topk,
        scaling_factor=scaling_factor, score_function=score_function, expert_bias=expert_bias, fused=False)


def _unfused_scores(*, logits, topk, score_function):
    return moe_utils.compute_routing_scores_for_aux_loss(logits, topk, score_function, fused=False)


@pytest.fixture
def unfused_kernels(monkeypatch):
    monkeypatch.setattr(fused_replay, "router_kernels", lambda: (_unfused_topk, _unfused_scores))


def _have_te_kernels() -> bool:
    try:
        fused_replay.router_kernels()
        return True
    except ReplayError:
        return False


@pytest.fixture(params=["unfused", "te"])
def kernels(request, monkeypatch):
    if request.param == "te":
        if not _have_te_kernels():
            pytest.skip("TE's fused router kernels need CUDA and Transformer Engine")
    else:
        monkeypatch.setattr(fused_replay, "router_kernels", lambda: (_unfused_topk, _unfused_scores))
    return request.param


@pytest.fixture(autouse=True)
def eager_router():
    """megatron torch.compile's its expert-bias helper; compiling it on a CPU costs seconds and decides no
    value compared here (both sides run the same eager code)."""
    with torch.compiler.set_stance("force_eager"):
        yield


@pytest.fixture(autouse=True)
def no_leftover_instances():
    RouterReplay.clear_global_router_replay_instances()
    yield
    RouterReplay.clear_global_router_replay_instances()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("action", ACTIONS)
def test_fused_replay_equals_megatrons_replay(kernels, case, action):
    compare(case, action, kernels)  # tests/jobs/fused_replay_check.py: maps exact, probs and grads close


@pytest.mark.parametrize("case", list(CASES))
def test_natural_routing_and_record_stay_megatrons(kernels, case):
    ref, ours = pair(CASES[case])
    x = torch.randn(5, 2, H, device=DEVICE)
    for action in (None, RouterReplayAction.RECORD):
        for r in (ref, ours):
            r.router_replay.clear_indices()
            if action is None:
                r.router_replay.clear_router_replay_action()
            else:
                r.router_replay.set_router_replay_action(action)
        (p_ref, m_ref), (p_our, m_our) = ref(x), ours(x)
        assert torch.equal(m_ref, m_our) and torch.equal(p_ref, p_our)
        if action is not None:
            assert torch.equal(ref.router_replay.recorded_topk_idx, ours.router_replay.recorded_topk_idx)


def test_refused_without_cuda_and_te():
    from tests.jobs.fused_replay_check import config

    if _have_te_kernels():
        pytest.skip("the refusal is for hosts without CUDA or Transformer Engine")
    with pytest.raises(ReplayError, match="needs (CUDA|Transformer Engine).*train.fused_router_replay=false"):
        FusedReplayRouter(config(), pg_collection=PG)


@pytest.mark.parametrize("bad,msg", [(dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01),
                                      "auxiliary load-balancing"),
                                     (dict(moe_expert_capacity_factor=1.0), "token dropping")])
def test_settings_it_would_not_reproduce_are_refused(unfused_kernels, bad, msg):
    kw = dict(num_layers=1, hidden_size=H, num_attention_heads=4, num_moe_experts=E, moe_router_topk=K,
              moe_ffn_hidden_size=16, moe_enable_routing_replay=True, moe_router_dtype="fp32",
              use_cpu_initialization=True, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
    with pytest.raises(ReplayError, match=msg):
        FusedReplayRouter(TransformerConfig(**(kw | bad)), pg_collection=PG)


@pytest.fixture
def gloo_world():
    with one_rank_gloo_world():
        yield


def test_policy_rl_step_is_the_same_with_fused_replay(ckpt_dir, gloo_world, unfused_kernels):
    """The trainer's own step (replayed routes, packing, GRPO loss, optimizer) on the tiny model with
    ``train.fused_router_replay`` on and off: its MoE layers get the fused-replay router from the spec,
    and the step's metrics and updated weights are megatron's replay path's."""
    from mrl.config.load import compose
    from mrl.megatron.parallel import init_parallel
    from mrl.megatron.policy import Policy
    from tests.jobs.resume_check import synthetic_batch

    results = {}
    for fused in (False, True):
        cfg = compose([f"model.hf_path={ckpt_dir['tiny']}", "algo.lr=1e-3", "train.micro_batch_size=2",
                       f"train.fused_router_replay={str(fused).lower()}"])
        policy = Policy(cfg, init_parallel(cfg.parallel, seed=cfg.seed), ckpt_dir["tiny"])
        routers = [m for m in policy.module.modules() if isinstance(m, TopKRouter)]
        assert routers and all(isinstance(r, FusedReplayRouter) == fused for r in routers)
        c = policy.codec
        batch = synthetic_batch(0, 8, policy.bridge.vocab_size, len(c.moe_layers), c.top_k, c.num_experts)
        m = policy.rl_step(batch, float(sum(len(t) - p for t, p in zip(batch.tokens, batch.prompt_lens))))
        results[fused] = (m, torch.cat([p.detach().flatten() for p in policy.module.parameters()]))
    (m_off, p_off), (m_on, p_on) = results[False], results[True]
    assert m_on.keys() == m_off.keys() and {"pg_loss", "grad_norm"} <= m_off.keys()
    for k in m_off:
        if "seconds" not in k and not k.endswith("_s"):
            assert m_on[k] == pytest.approx(m_off[k], rel=1e-5, abs=1e-7), (k, m_on[k], m_off[k])
    assert float((p_on - p_off).abs().max()) < 1e-6


def test_a_spec_that_keeps_plain_routers_is_refused(ckpt_dir, gloo_world, unfused_kernels, monkeypatch):
    """Should megatron's spec take another form, the option must fail, not run without effect."""
    from mrl.config.load import compose
    from mrl.megatron.parallel import init_parallel
    from mrl.megatron.policy import Policy

    monkeypatch.setattr(fused_replay, "with_fused_replay_router", lambda spec: spec)
    cfg = compose([f"model.hf_path={ckpt_dir['tiny']}", "train.fused_router_replay=true"])
    with pytest.raises(ReplayError, match="built plain routers"):
        Policy(cfg, init_parallel(cfg.parallel, seed=cfg.seed), ckpt_dir["tiny"])
