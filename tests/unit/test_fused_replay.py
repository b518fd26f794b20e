"""Keep Routing through TE's fused router kernels (``mrl.routing.fused_replay``) against megatron's own
replay path. TE's kernels need CUDA; without them (``kernels="unfused"``) they are replaced by megatron's
unfused functions of the same contract (``topk_routing_with_score_function`` and
``compute_routing_scores_for_aux_loss`` with ``fused=False``), so what is checked is the path's own math:
the masking, the gather for pre-softmax scores, the ids taken from megatron's ``RouterReplay`` queues, and
the spec that plugs the router in. On a GPU host with Transformer Engine the router tests also run with
TE's own kernels (``kernels="te"``)."""

from types import SimpleNamespace

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

E, K, H = 16, 4, 32


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


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (probs, grads) tolerances: the unfused stand-ins do the same float operations as megatron's replay
# path; TE's kernels round in their own order
TOL = {"unfused": ((1e-6, 1e-7), (1e-5, 1e-7)), "te": ((1e-5, 1e-6), (1e-4, 1e-6))}


@pytest.fixture(params=["unfused", "te"])
def kernels(request, monkeypatch):
    if request.param == "te":
        if not _have_te_kernels():
            pytest.skip("TE's fused router kernels need CUDA and Transformer Engine")
    else:
        monkeypatch.setattr(fused_replay, "router_kernels", lambda: (_unfused_topk, _unfused_scores))
    return request.param


@pytest.fixture(autouse=True)
def no_leftover_instances():
    RouterReplay.clear_global_router_replay_instances()
    yield
    RouterReplay.clear_global_router_replay_instances()


CASES = {
    "softmax_after_topk": dict(),  # Qwen3-MoE (norm_topk_prob)
    "softmax_before_topk": dict(moe_router_pre_softmax=True, moe_router_topk_scaling_factor=2.5),
    "sigmoid_bias_groups": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                                moe_router_num_groups=4, moe_router_group_topk=2,
                                moe_router_topk_scaling_factor=2.5),  # DeepSeek-V3's kind
}


def _config(**kw):
    return TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4, num_moe_experts=E,
                             moe_router_topk=K, moe_ffn_hidden_size=16, moe_enable_routing_replay=True,
                             moe_router_dtype="fp32", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                             use_cpu_initialization=True, **kw)


def _pair(kw):
    """megatron's router and the fused-replay one with the same weights (and expert bias)."""
    pg = SimpleNamespace(tp=None, cp=None, tp_cp=None, tp_dp_cp=None)
    torch.manual_seed(0)
    ref = TopKRouter(_config(**kw), pg_collection=pg)
    ours = FusedReplayRouter(_config(**kw), pg_collection=pg)
    ours.load_state_dict(ref.state_dict())
    if ref.expert_bias is not None:
        bias = torch.randn(E) * 0.5  # large enough to move natural top-k: replay must ignore it
        ref.expert_bias.copy_(bias)
        ours.expert_bias.copy_(bias)
    return ref, ours


def _replayed_ids(tokens, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(tokens, E, generator=g).argsort(1)[:, :K].to(DEVICE)  # distinct, unlike natural routing


def _run(router, x, ids_list, action, grad_w):
    """``router``'s forward per micro-batch under ``action`` (ids queued as megatron's driver queues
    them), then a backward: probs, routing maps, grads of input and gate weight."""
    router.zero_grad(set_to_none=True)
    rr = router.router_replay
    rr.clear_indices()
    for ids in ids_list:
        rr.set_target_indices(ids)
    rr.set_router_replay_action(action)
    xs = [x.clone().requires_grad_(True) for _ in ids_list]
    outs = [router(xi) for xi in xs]
    sum((p * grad_w).sum() for p, _ in outs).backward()
    rr.clear_router_replay_action()
    return ([p.detach() for p, _ in outs], [m for _, m in outs], [xi.grad for xi in xs], router.weight.grad.clone())


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("action", [RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.REPLAY_BACKWARD])
def test_fused_replay_equals_megatrons_replay(kernels, case, action):
    (p_rtol, p_atol), (g_rtol, g_atol) = TOL[kernels]
    ref, ours = _pair(CASES[case])
    s, b = 6, 3
    x = torch.randn(s, b, H, device=DEVICE)
    grad_w = torch.randn(s * b, E, device=DEVICE)
    # REPLAY_FORWARD uses the last ids set; REPLAY_BACKWARD pops the queue in order (recompute)
    ids = [_replayed_ids(s * b, 1), _replayed_ids(s * b, 2)]
    ids_list = ids if action == RouterReplayAction.REPLAY_BACKWARD else ids[:1]
    p_ref, m_ref, gx_ref, gw_ref = _run(ref, x, ids_list, action, grad_w)
    p_our, m_our, gx_our, gw_our = _run(ours, x, ids_list, action, grad_w)
    for j, i in enumerate(ids_list):
        want = torch.zeros(s * b, E, dtype=torch.bool, device=DEVICE).scatter_(1, i, True)
        assert torch.equal(m_ref[j], want) and torch.equal(m_our[j], want)  # exactly the replayed experts
        torch.testing.assert_close(p_our[j], p_ref[j], rtol=p_rtol, atol=p_atol)
        torch.testing.assert_close(gx_our[j], gx_ref[j], rtol=g_rtol, atol=g_atol)
    torch.testing.assert_close(gw_our, gw_ref, rtol=g_rtol, atol=g_atol)
    assert not ours.router_replay.replay_backward_list or action == RouterReplayAction.REPLAY_FORWARD


@pytest.mark.parametrize("case", list(CASES))
def test_natural_routing_and_record_stay_megatrons(kernels, case):
    ref, ours = _pair(CASES[case])
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
    pg = SimpleNamespace(tp=None, cp=None, tp_cp=None, tp_dp_cp=None)
    if _have_te_kernels():
        pytest.skip("the refusal is for hosts without CUDA or Transformer Engine")
    with pytest.raises(ReplayError, match="needs (CUDA|Transformer Engine).*train.fused_router_replay=false"):
        FusedReplayRouter(_config(), pg_collection=pg)


@pytest.mark.parametrize("bad,msg", [(dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01),
                                      "auxiliary load-balancing"),
                                     (dict(moe_expert_capacity_factor=1.0), "token dropping")])
def test_settings_it_would_not_reproduce_are_refused(unfused_kernels, bad, msg):
    pg = SimpleNamespace(tp=None, cp=None, tp_cp=None, tp_dp_cp=None)
    kw = dict(num_layers=1, hidden_size=H, num_attention_heads=4, num_moe_experts=E, moe_router_topk=K,
              moe_ffn_hidden_size=16, moe_enable_routing_replay=True, moe_router_dtype="fp32",
              use_cpu_initialization=True, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
    with pytest.raises(ReplayError, match=msg):
        FusedReplayRouter(TransformerConfig(**(kw | bad)), pg_collection=pg)


@pytest.fixture
def gloo_world():
    """A one-process gloo world on a free port for in-process megatron models."""
    import os
    import socket

    from mrl.megatron.parallel import destroy

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    yield
    destroy()
    for k, v in saved.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


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
