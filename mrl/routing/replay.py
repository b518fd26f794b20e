"""Keep Routing: replay the engine's expert choices in megatron's forward (and recompute) passes.

megatron-core's own ``RouterReplay`` is the mechanism (one instance per local MoE layer, in
construction order; actions RECORD / REPLAY_FORWARD / REPLAY_BACKWARD). This module only feeds it:

- **alignment**: a sample's routes are ``[prompt + response - 1, moe_layers, K]`` (the engine never
  routes the last sampled token): one pad row is appended, padding positions get valid ids
  (``arange % experts``), and micro-batches are stacked ``[B, S, L, K]``;
- **slicing**: router input is ``[s, b, h]`` flattened s-first, so a rank's token i is
  ``s * b_local + b``; with context parallelism a rank holds the positions megatron's split gives its
  tokens (``mrl.megatron.context_parallel``: chunks r and 2cp-1-r of 2cp, per packed segment for THD),
  taken with the same index; with sequence parallelism each TP rank routes its own ``S / tp`` chunk of
  that; a PP stage takes the columns of its own MoE layers;
- **micro-batches and recompute**: ``set_replay_data`` once per micro-batch, right before its
  forward (it also queues the ids for recompute); a gradient hook on the micro-batch output switches
  to REPLAY_BACKWARD when its backward starts, so activation recompute pops the same ids in
  megatron's 1F1B order; the next forward switches back.

A ``ReplayDriver`` is held per model (no module state of ours); ``close()`` clears megatron's global
action and queues. Configurations in which megatron would silently skip replay are refused.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch

from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction


class ReplayError(ValueError):
    pass


class ReplayMode(str, enum.Enum):
    off = "off"  # natural routing
    replay = "replay"  # the engine's recorded experts
    record = "record"  # natural routing, recorded (metrics: how far natural routing drifted)


def check_replayable(cfg) -> None:
    """Refuse megatron configs whose router returns before the replay hook (``moe_utils.py``)."""
    if not getattr(cfg, "moe_enable_routing_replay", False):
        raise ReplayError("routing replay needs TransformerConfig.moe_enable_routing_replay=True")
    if getattr(cfg, "moe_router_fusion", False):
        raise ReplayError("moe_router_fusion=True (TE fused router) skips megatron's RouterReplay: "
                          "replayed experts would be silently ignored; set it to False")
    if getattr(cfg, "moe_router_load_balancing_type", "none") in ("sinkhorn",):
        raise ReplayError("sinkhorn routing does not go through RouterReplay; use top-k routing")
    if getattr(cfg, "moe_router_score_function", "softmax") not in ("softmax", "sigmoid"):
        raise ReplayError(f"router score function {cfg.moe_router_score_function!r} is not replayable")


def check_routes(num_tokens: int, routes: np.ndarray | None, *, num_moe_layers: int, top_k: int,
                 num_experts: int) -> str | None:
    """Why a sample's routes cannot be replayed (None when they can): missing, wrong shape, bad ids."""
    if routes is None:
        return "routes missing (engine started without --enable-return-routed-experts, or empty response?)"
    want = (num_tokens - 1, num_moe_layers, top_k)
    if tuple(routes.shape) != want:
        return f"routes shape {tuple(routes.shape)} != {want} ([tokens - 1, moe layers, top_k])"
    if routes.size and int(routes.max()) >= num_experts:
        return f"expert id {int(routes.max())} >= {num_experts} experts"
    return None


def align_routes(routes: np.ndarray, seq_len: int, num_experts: int) -> np.ndarray:
    """``[n - 1, L, K]`` engine routes of an n-token sequence -> ``[seq_len, L, K]`` rows: uint8 stays
    uint8 (up to 256 experts: an eighth of int64's bytes on their way to the device), other ids become
    int32; ``ReplayDriver`` widens them to int64 on the device.

    The final token of a sample and padding positions are routed to ``arange % experts`` (valid, never
    trained on: their loss mask is 0)."""
    rows, layers, k = routes.shape
    if rows + 1 > seq_len:
        raise ReplayError(f"routes have {rows} rows but the sequence is padded to {seq_len} tokens")
    dtype = np.uint8 if routes.dtype == np.uint8 else np.int32
    pad = np.broadcast_to((np.arange(k) % num_experts).astype(dtype), (seq_len - rows, layers, k))
    return np.concatenate([routes.astype(dtype, copy=False), pad], 0)


@dataclass(frozen=True)
class RankSlice:
    """Which tokens and MoE layers this rank's routers see."""

    tp_rank: int
    tp_size: int
    sequence_parallel: bool
    moe_columns: tuple[int, ...]
    """Columns of the routes' layer axis that live on this PP stage, in local construction order."""

    def tokens(self, routes_bslk: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, S, L, K]`` -> ``[S_local * B, L_local, K]`` in the router's s-first token order."""
        k = routes_bslk.shape[-1]
        x = self.rows(self._columns(routes_bslk), positions)
        return x.reshape(-1, len(self.moe_columns), k)

    def _columns(self, routes_bslk: torch.Tensor) -> torch.Tensor:
        """This stage's MoE columns. A PP stage's sparse layers are consecutive (``stage_moe_columns``), so
        this is a view; indexing a device tensor with a Python list would first copy the list to the device
        from pageable memory, which waits for the stream to drain, once per micro-batch inside the schedule."""
        cols = self.moe_columns
        if cols and cols == tuple(range(cols[0], cols[0] + len(cols))):
            return routes_bslk[:, :, cols[0]:cols[0] + len(cols)]
        return routes_bslk[:, :, list(cols)]

    def rows(self, x_bs: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, S, ...]`` per-token values -> ``[S_local * B, ...]`` in the router's token order: the
        context-parallel split first (``positions``: this CP rank's sequence positions in its token order,
        ``mrl.megatron.context_parallel.CPSplit.index``, the same index its tokens were taken with), then
        the sequence-parallel chunk of the CP-local sequence (megatron scatters the embeddings over TP),
        flattened s-first."""
        if positions is not None:
            x_bs = x_bs.index_select(1, positions.to(x_bs.device))
        s = x_bs.shape[1]
        x = x_bs.transpose(0, 1)  # [S, B, ...]
        if self.sequence_parallel and self.tp_size > 1:
            if s % self.tp_size:
                raise ReplayError(f"sequence length {s} not divisible by tp={self.tp_size} (sequence parallel)")
            chunk = s // self.tp_size
            x = x[self.tp_rank * chunk:(self.tp_rank + 1) * chunk]
        return x.reshape(-1, *x.shape[2:])


def stage_moe_columns(moe_layers: tuple[int, ...], stage_layers: list[int], stage: int) -> tuple[int, ...]:
    """Indices into ``moe_layers`` (global sparse layer ids) of the sparse layers on PP ``stage``."""
    lo = sum(stage_layers[:stage])
    hi = lo + stage_layers[stage]
    return tuple(i for i, layer in enumerate(moe_layers) if lo <= layer < hi)


class ReplayDriver:
    """Feeds megatron's RouterReplay for one model; one object per model, reused every step."""

    def __init__(self, cfg, rank_slice: RankSlice, mode: ReplayMode = ReplayMode.replay):
        if mode != ReplayMode.off:
            check_replayable(cfg)
        self.slice, self.mode = rank_slice, mode
        self.instances = list(RouterReplay.global_router_replay_instances)
        if mode != ReplayMode.off and len(self.instances) != len(rank_slice.moe_columns):
            raise ReplayError(f"{len(self.instances)} RouterReplay instances on this rank but "
                              f"{len(rank_slice.moe_columns)} MoE layers expected: was another model built "
                              "after this one? (megatron keeps the instances process-global)")
        self.recorded: list[list[torch.Tensor]] = []

    def before_forward(self, routes_bslk: torch.Tensor | None, positions: torch.Tensor | None = None) -> None:
        """Call right before a micro-batch's forward (inside megatron's forward_step); ``positions``: this
        context-parallel rank's sequence positions (``RankSlice.rows``), None without CP."""
        if self.mode == ReplayMode.off:
            RouterReplay.clear_global_router_replay_action()
            return
        if self.mode == ReplayMode.record:
            RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
            return
        if routes_bslk is None:
            raise ReplayError("replay mode but this micro-batch has no routes")
        local = self.slice.tokens(routes_bslk, positions)  # [T, L, K]
        # megatron gathers scores with int64 ids, one contiguous [T, K] per layer: widened and laid out
        # layer-major in one copy, not one per layer
        per_layer = local.transpose(0, 1).to(torch.long, memory_format=torch.contiguous_format)
        RouterReplay.set_replay_data(list(per_layer.unbind(0)))
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def after_forward(self, output: torch.Tensor) -> torch.Tensor:
        """Call on the micro-batch output: recompute in its backward replays the queued ids."""
        if self.mode == ReplayMode.record:
            self.recorded.append([t.clone() for t in RouterReplay.get_recorded_data()])
        if self.mode == ReplayMode.replay and output.requires_grad:
            output.register_hook(_switch_to_backward)
        return output

    def close(self) -> None:
        """After a step: megatron's action off and every queue empty (nothing leaks into the next step)."""
        RouterReplay.clear_global_router_replay_action()
        RouterReplay.clear_global_indices()


def _switch_to_backward(grad: torch.Tensor) -> torch.Tensor:
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
    return grad


def routing_disagreement(natural: torch.Tensor, replayed: torch.Tensor, valid: torch.Tensor | None = None) -> float:
    """Fraction of (token, layer) decisions whose expert *sets* differ; ``[T, L, K]`` each."""
    a, _ = natural.sort(-1)
    b, _ = replayed.sort(-1)
    differ = (a != b).any(-1)  # [T, L]
    if valid is not None:
        differ = differ[valid]
    return float(differ.float().mean()) if differ.numel() else 0.0
