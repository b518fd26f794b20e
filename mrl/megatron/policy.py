"""The trainer side of the RL loop: megatron model + DDP + DistributedOptimizer, one RL or SFT step.

Every trainer rank holds a ``Policy``; batches arrive as plain python (``RLBatch``) from the
controller (rank 0) and each rank takes its DP slice. Checkpoints use megatron's dist_checkpointing
(model + optimizer, resharding-safe) plus a small per-rank file for RNG state.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from mrl.algo import compute_policy_loss
from mrl.config.schema import Config
from mrl.megatron import compat
from mrl.megatron.model import build_gpt_model, transformer_config
from mrl.megatron.optim import build_optimizer, wrap_ddp
from mrl.megatron.parallel import Layout
from mrl.megatron.train_step import MicroBatch, forward_backward
from mrl.megatron.weights import load_hf_into
from mrl.models import get_bridge
from mrl.models.checkpoint import HFCheckpoint
from mrl.routing.codec import RoutesCodec
from mrl.routing.replay import RankSlice, ReplayDriver, ReplayMode, align_routes, routing_disagreement, stage_moe_columns
from megatron.core import dist_checkpointing
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


@dataclass
class RLBatch:
    """One step's samples, in group order (rank 0 builds it, every rank receives it)."""

    tokens: list[list[int]]
    prompt_lens: list[int]
    behav_logp: list[list[float]]
    """Engine logprob of each response token (the behaviour policy)."""
    advantages: list[float]
    routes: list[np.ndarray] | None
    """``[n - 1, moe_layers, K]`` engine routes per sample (None: replay off)."""

    def __len__(self) -> int:
        return len(self.tokens)


def _mean(values: list[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0


class Policy:
    def __init__(self, cfg: Config, layout: Layout, hf_path: str):
        self.cfg, self.layout = cfg, layout
        self.bridge = get_bridge(hf_path)
        self.tcfg = transformer_config(self.bridge, cfg.parallel, dtype=cfg.model.dtype)
        self.padded_vocab = self.bridge.padded_vocab(cfg.model.vocab_divisible_by, cfg.parallel.tp)
        model = build_gpt_model(self.bridge, self.tcfg, layout, self.padded_vocab)
        load_hf_into(model, layout, self.bridge, HFCheckpoint(hf_path), self.padded_vocab)
        self.model = wrap_ddp(model, self.tcfg)
        t = cfg.train
        self.optimizer = build_optimizer([self.model], lr=cfg.algo.lr, clip_grad=t.clip_grad,
                                         weight_decay=t.weight_decay, bf16=self.tcfg.bf16)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if t.lr_warmup_steps else cfg.algo.lr, max_lr=cfg.algo.lr,
            min_lr=cfg.algo.lr, lr_warmup_steps=t.lr_warmup_steps, lr_decay_steps=max(t.steps, 1),
            lr_decay_style="constant", start_wd=t.weight_decay, end_wd=t.weight_decay, wd_incr_steps=1,
            wd_incr_style="constant")
        self.codec = RoutesCodec.from_bridge(self.bridge)
        rs = RankSlice(tp_rank=layout.tp.rank, tp_size=layout.tp.size,
                       sequence_parallel=self.tcfg.sequence_parallel,
                       moe_columns=stage_moe_columns(self.codec.moe_layers,
                                                     cfg.parallel.stage_layers(self.bridge.num_layers),
                                                     layout.pp.rank))
        self.replay = ReplayDriver(self.tcfg, rs, ReplayMode.replay if t.replay else ReplayMode.off)
        self.record = ReplayDriver(self.tcfg, rs, ReplayMode.record)

    @property
    def module(self) -> torch.nn.Module:
        return self.model.module

    # -- batches ---------------------------------------------------------------------------------
    def _micro_batches(self, batch: RLBatch, with_routes: bool) -> tuple[list[MicroBatch], list[int]]:
        """This DP rank's slice of ``batch`` as equal-shape micro-batches; returns them and the indices."""
        dp, r = self.layout.dp.size, self.layout.dp.rank
        n = len(batch)
        mbs_size = self.cfg.train.micro_batch_size
        if n % dp:
            raise ValueError(f"batch of {n} samples does not split over dp={dp}")
        mine = list(range(r * n // dp, (r + 1) * n // dp))
        seq = max(len(t) for t in batch.tokens)
        seq += (-seq) % self.layout.tp.size  # sequence parallelism splits S over TP
        size = min(mbs_size, len(mine))
        while len(mine) % size:
            size -= 1
        out = []
        for j in range(0, len(mine), size):
            idx = mine[j:j + size]
            ids = torch.zeros(size, seq, dtype=torch.long)
            mask = torch.zeros(size, seq - 1)
            behav = torch.zeros(size, seq - 1)
            adv = torch.zeros(size)
            valid = torch.zeros(size, seq)  # rows the engine routed: every token but the last
            routes = []
            for b, i in enumerate(idx):
                toks, p = batch.tokens[i], batch.prompt_lens[i]
                ids[b, :len(toks)] = torch.tensor(toks)
                resp = len(toks) - p
                mask[b, p - 1:p - 1 + resp] = 1.0  # position t predicts token t + 1
                behav[b, p - 1:p - 1 + resp] = torch.tensor(batch.behav_logp[i][:resp], dtype=torch.float32)
                adv[b] = batch.advantages[i]
                valid[b, :len(toks) - 1] = 1.0
                if with_routes:
                    routes.append(align_routes(batch.routes[i], seq, self.codec.num_experts))
            dev = compat.DEVICE
            out.append(MicroBatch(ids.to(dev), torch.from_numpy(np.stack(routes)).to(dev) if with_routes else None,
                                  {"mask": mask.to(dev), "behav": behav.to(dev), "adv": adv.to(dev),
                                   "valid": valid.to(dev)}))
        return out, mine

    # -- steps -----------------------------------------------------------------------------------
    def rl_step(self, batch: RLBatch, normalizer: float) -> dict[str, float]:
        replay = self.cfg.train.replay and batch.routes is not None
        mbs, _ = self._micro_batches(batch, replay)
        algo = self.cfg.algo

        def loss_fn(lp, mb):
            d = mb.data
            # one optimizer step per batch: pi_old is this forward's own (detached) logprobs, so the PPO
            # ratio starts at 1 and the correction weight pi_old / pi_engine carries all off-policyness
            return compute_policy_loss(lp, lp.detach(), d["behav"], d["adv"], d["mask"], algo,
                                       normalizer=normalizer)

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        outs = forward_backward(self.model, self.layout, mbs, vocab_size=self.bridge.vocab_size,
                                loss_fn=loss_fn, driver=self.replay if replay else None,
                                loss_scale=float(self.layout.dp.size))
        ok, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        metrics: dict[str, Any] = {"grad_norm": float(grad_norm or 0.0), "update_ok": float(bool(ok)),
                                   "lr": self.optimizer.param_groups[0]["lr"]}
        if outs:
            for key in outs[0]:
                if key != "logprobs":
                    metrics[key] = _mean([float(o[key]) for o in outs])
            metrics |= self._engine_gap(outs, mbs, "replay_on" if replay else "replay_off")
        return self._reduce(metrics)

    def routing_metrics(self, batch: RLBatch) -> dict[str, float]:
        """Natural routing (RECORD, no replay) vs the engine's: disagreement rate, and the train-vs-engine
        logprob gap with replay off (the replay-on gap comes with the training step itself)."""
        if batch.routes is None:
            return {}
        mbs, _ = self._micro_batches(batch, True)
        self.record.recorded.clear()
        outs = forward_backward(self.model, self.layout, mbs, vocab_size=self.bridge.vocab_size,
                                forward_only=True, driver=self.record)
        rates = []
        for mb, rec in zip(mbs, self.record.recorded):
            want = self.record.slice.tokens(mb.routes)  # [T_local, L_local, K] in router order
            got = torch.stack([t.to(want.device) for t in rec], 1)
            valid = self.record.slice.rows(mb.data["valid"]) > 0
            rates.append(routing_disagreement(got, want, valid))
        metrics = {"routing_disagreement": _mean(rates)} if rates else {}
        if outs:
            metrics |= self._engine_gap(outs, mbs, "replay_off")
        return self._reduce(metrics)

    def _engine_gap(self, outs, mbs, tag: str) -> dict[str, float]:
        diffs, kls = [], []
        for o, mb in zip(outs, mbs):
            m = mb.data["mask"] > 0
            d = (o["logprobs"] - mb.data["behav"])[m]  # log pi_train - log pi_engine
            diffs.append(float(d.abs().mean()) if d.numel() else 0.0)
            kls.append(float((d.exp() - 1 - d).mean()) if d.numel() else 0.0)
        return {f"logprob_diff_{tag}": _mean(diffs), f"kl_engine_{tag}": _mean(kls)}

    def sft_step(self, tokens: list[list[int]], prompt_lens: list[int], lr: float) -> float:
        """Supervised warm start: mean NLL of the answer tokens, natural routing."""
        batch = RLBatch(tokens=tokens, prompt_lens=prompt_lens, behav_logp=[[0.0] * len(t) for t in tokens],
                        advantages=[0.0] * len(tokens), routes=None)
        mbs, _ = self._micro_batches(batch, False)
        total = sum(float(mb.data["mask"].sum()) for mb in mbs)
        box = torch.tensor([total], dtype=torch.float64)
        dist.all_reduce(box, group=self.layout.dp.group)

        def loss_fn(lp, mb):
            m = mb.data["mask"]
            loss = -(lp * m).sum() / float(box)
            return loss, {"nll": loss.detach() * float(box) / max(float(m.sum()), 1.0)}

        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        outs = forward_backward(self.model, self.layout, mbs, vocab_size=self.bridge.vocab_size, loss_fn=loss_fn,
                                loss_scale=float(self.layout.dp.size))
        self.optimizer.step()
        return self._reduce({"nll": _mean([float(o["nll"]) for o in outs])} if outs else {}).get("nll", 0.0)

    def _reduce(self, metrics: dict[str, float]) -> dict[str, float]:
        """Metrics of the ranks that have them, averaged, on every rank."""
        box = [None] * self.layout.world_size
        dist.all_gather_object(box, metrics)
        keys = sorted({k for m in box for k in m})
        return {k: _mean([m[k] for m in box if k in m]) for k in keys}

    # -- checkpoints -----------------------------------------------------------------------------
    # megatron.md #13/#14: only this sharding type saves and reloads torch-Adam state (any layout)
    _CKPT_META = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}

    def _sharded(self, is_loading: bool) -> dict:
        model_sd = self.module.sharded_state_dict(metadata=self._CKPT_META)
        if is_loading:  # megatron.md #10: a fresh torch-Adam state has no entries to load into
            for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                if hasattr(opt, "_init_optimizer_states_with_dummy_values"):
                    opt._init_optimizer_states_with_dummy_values()
        return {"model": model_sd, "optimizer": self.optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata=self._CKPT_META)}

    def save(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        sd = self._sharded(False)
        dist_checkpointing.save(sd, path)
        rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
               "scheduler": self.scheduler.state_dict()}
        torch.save(rng, os.path.join(path, f"rng_rank{self.layout.world_rank}.pt"))
        dist.barrier()

    def load(self, path: str) -> None:
        state = dist_checkpointing.load(self._sharded(True), path)
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        rng = torch.load(os.path.join(path, f"rng_rank{self.layout.world_rank}.pt"), weights_only=False)
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        self.scheduler.load_state_dict(rng["scheduler"])
        dist.barrier()
