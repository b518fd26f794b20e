"""Keep Routing through Transformer Engine's fused router kernels (``train.fused_router_replay``, GPU only).

megatron-core's fused router (``moe_router_fusion=True``) returns from ``topk_routing_with_score_function``
before it consults ``RouterReplay``, so replay runs megatron's unfused router: a gather, a softmax, casts
and two scatters per MoE layer and pass. ``FusedReplayRouter`` is megatron's ``TopKRouter`` (plugged in
through the layer spec) whose two replay actions compute the replayed routing with TE's kernels instead,
to the same values megatron's unfused replay path gives:

- softmax after top-k (Qwen3-MoE: ``norm_topk_prob``) and sigmoid: the logits of every expert the token
  was not routed to are set to -inf and TE's fused top-k kernel runs on them without expert bias or
  groups. Its top-k then selects exactly the replayed experts (the only finite entries), the softmax is
  taken over their logits (megatron's replay: ``softmax(logits.gather(ids))``), a sigmoid's scores are
  normalised over them (``sigmoid(logits).gather(ids) / sum``); expert bias and group limits only choose
  experts, which replay does not, so leaving them out changes no value. The kernel writes the
  ``[tokens, experts]`` probabilities and routing map megatron's dispatcher takes in the same launch.
- softmax before top-k (``moe_router_pre_softmax``): masking would change the softmax's denominator, so
  TE's fused score kernel (the one megatron's fused aux loss uses) gives the softmax over all experts and
  the replayed experts' probabilities are gathered from it, as megatron's replay path gathers them.

Every other action (natural routing, RECORD) is megatron's own unfused ``routing``. Replayed ids must be
distinct per token (the routes codec refuses repeats; pad rows are ``arange % experts``). Auxiliary losses
and token dropping are refused (mrl trains with neither): megatron computes them from natural routing,
which this path does not run.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import torch

from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction
from mrl.routing.replay import ReplayError

TopkKernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""TE's ``fused_topk_with_score_function(logits=, topk=, use_pre_softmax=, num_groups=, group_topk=,
scaling_factor=, score_function=, expert_bias=) -> (probs [T, E], routing_map [T, E])``."""
ScoresKernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""TE's ``fused_compute_score_for_moe_aux_loss(logits=, topk=, score_function=) -> (routing_map, scores)``."""

_REPLAY_ACTIONS = (RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.REPLAY_BACKWARD)


def router_kernels() -> tuple[TopkKernel, ScoresKernel]:
    """TE's fused router kernels as megatron imports them; a clear error where they cannot run."""
    if not torch.cuda.is_available():
        raise ReplayError("train.fused_router_replay needs CUDA (Transformer Engine's fused router kernels); "
                          "set train.fused_router_replay=false")
    try:
        from megatron.core.extensions.transformer_engine import (fused_compute_score_for_moe_aux_loss,
                                                                 fused_topk_with_score_function)
    except ImportError as e:
        raise ReplayError(f"train.fused_router_replay needs Transformer Engine ({e}); "
                          "set train.fused_router_replay=false") from e
    if fused_topk_with_score_function is None or fused_compute_score_for_moe_aux_loss is None:
        raise ReplayError("train.fused_router_replay needs Transformer Engine >= 2.7 (its fused router "
                          "kernels); set train.fused_router_replay=false")
    return fused_topk_with_score_function, fused_compute_score_for_moe_aux_loss


def replayed_routing(logits: torch.Tensor, ids: torch.Tensor, *, topk: int, use_pre_softmax: bool,
                     score_function: str, scaling_factor: float | None, topk_kernel: TopkKernel,
                     scores_kernel: ScoresKernel) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, E]`` logits and ``[T, K]`` replayed expert ids -> megatron's ``(routing_probs [T, E],
    routing_map [T, E] bool)`` for those ids, through the fused kernels (module docstring)."""
    if score_function == "softmax" and use_pre_softmax:
        _, scores = scores_kernel(logits=logits, topk=topk, score_function="softmax")
        probs = scores.gather(1, ids)
        if scaling_factor:
            probs = probs * scaling_factor
        probs = probs.type_as(logits)
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, ids, True)
        return torch.zeros_like(logits).scatter(1, ids, probs), routing_map
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, ids, True)
    masked = logits.masked_fill(~keep, float("-inf"))
    return topk_kernel(logits=masked, topk=topk, use_pre_softmax=False, num_groups=None, group_topk=None,
                       scaling_factor=scaling_factor, score_function=score_function, expert_bias=None)


def check_fused_replayable(router: TopKRouter) -> None:
    """Refuse router settings whose replayed values this path would not reproduce."""
    cfg = router.config
    if not cfg.moe_enable_routing_replay:
        raise ReplayError("train.fused_router_replay needs TransformerConfig.moe_enable_routing_replay=True")
    if router.routing_type in ("sinkhorn", "quantile_balancing"):
        raise ReplayError(f"{router.routing_type} routing does not go through RouterReplay")
    if router.score_function not in ("softmax", "sigmoid"):
        raise ReplayError(f"router score function {router.score_function!r} is not replayable")
    if router.is_aux_loss_enabled():
        raise ReplayError("train.fused_router_replay: auxiliary load-balancing losses are computed from natural "
                          "routing, which the fused replay path does not run; set moe_aux_loss_coeff=0 or "
                          "train.fused_router_replay=false")
    if cfg.moe_expert_capacity_factor is not None:
        raise ReplayError("train.fused_router_replay: token dropping (moe_expert_capacity_factor) is not "
                          "supported; set train.fused_router_replay=false")


class FusedReplayRouter(TopKRouter):
    """megatron's ``TopKRouter``; its REPLAY_FORWARD / REPLAY_BACKWARD actions go through TE's fused
    router kernels (``replayed_routing``), taking the ids from megatron's ``RouterReplay`` exactly as its
    ``get_replay_topk`` does (the forward's target, recompute's queue in order)."""

    def __init__(self, config, pg_collection=None, is_mtp_layer: bool = False):
        super().__init__(config=config, pg_collection=pg_collection, is_mtp_layer=is_mtp_layer)
        check_fused_replayable(self)
        self._topk_kernel, self._scores_kernel = router_kernels()

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        replay = self.router_replay
        action = replay.router_replay_action if replay is not None else None
        if action not in _REPLAY_ACTIONS:
            return super().routing(logits, padding_mask=padding_mask)
        ids = replay.target_topk_idx if action == RouterReplayAction.REPLAY_FORWARD \
            else replay.replay_backward_list.pop(0)
        logits = logits.view(-1, self.config.num_moe_experts)
        if padding_mask is not None:
            padding_mask = padding_mask.reshape(-1)
        logits = self.apply_z_loss(logits, padding_mask=padding_mask)
        probs, routing_map = replayed_routing(
            logits, ids.to(logits.device), topk=self.topk, use_pre_softmax=self.config.moe_router_pre_softmax,
            score_function=self.score_function, scaling_factor=self.config.moe_router_topk_scaling_factor,
            topk_kernel=self._topk_kernel, scores_kernel=self._scores_kernel)
        self._apply_expert_bias(routing_map, padding_mask=padding_mask)
        return probs, routing_map


def with_fused_replay_router(spec):
    """A megatron decoder block spec whose MoE layers build ``FusedReplayRouter`` (dense layers as they
    were). megatron's GPT specs give each MoE layer's MLP as ``partial(MoELayer, submodules=...)``."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    layers, swapped = [], 0
    for ls in spec.layer_specs:
        mlp = ls.submodules.mlp
        if isinstance(mlp, functools.partial) and mlp.func is MoELayer and "submodules" in mlp.keywords:
            sub = dataclasses.replace(mlp.keywords["submodules"], router=FusedReplayRouter)
            mlp = functools.partial(MoELayer, *mlp.args, **{**mlp.keywords, "submodules": sub})
            ls = dataclasses.replace(ls, submodules=dataclasses.replace(ls.submodules, mlp=mlp))
            swapped += 1
        layers.append(ls)
    if not swapped and any(getattr(ls.submodules.mlp, "func", None) is MoELayer for ls in spec.layer_specs):
        raise ReplayError("train.fused_router_replay: megatron's MoE layer spec has an unexpected form")
    return dataclasses.replace(spec, layer_specs=layers)
