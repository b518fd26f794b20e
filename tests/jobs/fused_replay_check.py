"""The fused-replay router (``mrl.routing.fused_replay``) against megatron's own replay path, router by router.

    python -m tests.jobs.fused_replay_check --out fused_replay.json     # GPU host with TE: TE's kernels

Used by ``tests/unit/test_fused_replay.py`` (CPU: megatron's unfused functions in the kernels' place) and
on GPU hosts without pytest (``scripts/gpu/jobs.sh``, job ``fusedreplay``): for softmax-after-top-k
(Qwen3-MoE), softmax-before-top-k and sigmoid routers with expert bias and groups, under REPLAY_FORWARD
and REPLAY_BACKWARD, the routing maps must be exactly the replayed experts and probabilities and the
gradients of input and gate weight must equal megatron's replay path within ``TOL``.
"""

from __future__ import annotations

import argparse
import json
import sys
from types import SimpleNamespace

import torch

from mrl.megatron import compat  # noqa: F401  (megatron's CPU paths, before megatron is imported)
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
from mrl.routing.fused_replay import FusedReplayRouter

E, K, H = 16, 4, 32
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CASES = {
    "softmax_after_topk": dict(),  # Qwen3-MoE (norm_topk_prob)
    "softmax_before_topk": dict(moe_router_pre_softmax=True, moe_router_topk_scaling_factor=2.5),
    "sigmoid_bias_groups": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                                moe_router_num_groups=4, moe_router_group_topk=2,
                                moe_router_topk_scaling_factor=2.5),  # DeepSeek-V3's kind
}
ACTIONS = (RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.REPLAY_BACKWARD)
# (probs, grads) as (rtol, atol): megatron's unfused functions do the same float operations as its replay
# path; TE's kernels round in their own order
TOL = {"unfused": ((1e-6, 1e-7), (1e-5, 1e-7)), "te": ((1e-5, 1e-6), (1e-4, 1e-6))}
PG = SimpleNamespace(tp=None, cp=None, tp_cp=None, tp_dp_cp=None)  # used by aux and z losses only (off)


def config(**kw) -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4, num_moe_experts=E,
                             moe_router_topk=K, moe_ffn_hidden_size=16, moe_enable_routing_replay=True,
                             moe_router_dtype="fp32", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                             use_cpu_initialization=True, **kw)


def pair(kw: dict) -> tuple[TopKRouter, FusedReplayRouter]:
    """megatron's router and the fused-replay one with the same weights (and expert bias)."""
    torch.manual_seed(0)
    ref = TopKRouter(config(**kw), pg_collection=PG)
    ours = FusedReplayRouter(config(**kw), pg_collection=PG)
    ours.load_state_dict(ref.state_dict())
    if ref.expert_bias is not None:
        bias = torch.randn(E) * 0.5  # large enough to move natural top-k: replay must ignore it
        ref.expert_bias.copy_(bias)
        ours.expert_bias.copy_(bias)
    return ref, ours


def replayed_ids(tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(tokens, E, generator=g).argsort(1)[:, :K].to(DEVICE)  # distinct, unlike natural routing


def run(router: TopKRouter, x: torch.Tensor, ids_list: list[torch.Tensor], action, grad_w: torch.Tensor):
    """``router``'s forward per micro-batch under ``action`` (ids queued as mrl's driver queues them), then
    a backward: probs, routing maps, grads of the inputs and of the gate weight."""
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
    return [p.detach() for p, _ in outs], [m for _, m in outs], [xi.grad for xi in xs], router.weight.grad.clone()


def compare(case: str, action, kernels: str) -> dict:
    """One case under one action; raises AssertionError on a mismatch, else returns the largest differences.
    REPLAY_FORWARD uses the last ids set; REPLAY_BACKWARD pops the queue in order (recompute)."""
    (p_rtol, p_atol), (g_rtol, g_atol) = TOL[kernels]
    RouterReplay.clear_global_router_replay_instances()
    try:
        ref, ours = pair(CASES[case])
        s, b = 6, 3
        x = torch.randn(s, b, H, device=DEVICE)
        grad_w = torch.randn(s * b, E, device=DEVICE)
        ids = [replayed_ids(s * b, 1), replayed_ids(s * b, 2)]
        ids_list = ids if action == RouterReplayAction.REPLAY_BACKWARD else ids[:1]
        p_ref, m_ref, gx_ref, gw_ref = run(ref, x, ids_list, action, grad_w)
        p_our, m_our, gx_our, gw_our = run(ours, x, ids_list, action, grad_w)
        for j, i in enumerate(ids_list):
            want = torch.zeros(s * b, E, dtype=torch.bool, device=DEVICE).scatter_(1, i, True)
            assert torch.equal(m_ref[j], want) and torch.equal(m_our[j], want), "routing map"
            torch.testing.assert_close(p_our[j], p_ref[j], rtol=p_rtol, atol=p_atol)
            torch.testing.assert_close(gx_our[j], gx_ref[j], rtol=g_rtol, atol=g_atol)
        torch.testing.assert_close(gw_our, gw_ref, rtol=g_rtol, atol=g_atol)
        if action == RouterReplayAction.REPLAY_BACKWARD:
            assert not ours.router_replay.replay_backward_list, "recompute queue not emptied"
        return {"probs_max_abs": max(float((a - b).abs().max()) for a, b in zip(p_our, p_ref)),
                "grad_input_max_abs": max(float((a - b).abs().max()) for a, b in zip(gx_our, gx_ref)),
                "grad_weight_max_abs": float((gw_our - gw_ref).abs().max())}
    finally:
        RouterReplay.clear_global_router_replay_instances()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    results, failed = {}, 0
    for case in CASES:
        for action in ACTIONS:
            key = f"{case}/{action.value}"
            try:
                results[key] = {"ok": True, **compare(case, action, "te")}
            except AssertionError as e:
                results[key] = {"ok": False, "error": str(e)[:2000]}
                failed += 1
    report = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "kernels": "te", "results": results, "failed": failed}
    print(json.dumps(report, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
