"""The trainer side of the RL loop: megatron model + DDP + DistributedOptimizer, one RL or SFT step.

Every trainer rank holds a ``Policy``; batches arrive as plain python (``RLBatch``: the whole batch, or
this DP rank's share of it from ``mrl.megatron.batch_scatter``) and each rank trains on its DP slice.
Checkpoints use megatron's dist_checkpointing (model + optimizer, resharding-safe) plus a small per-rank
file for RNG state.
"""

from __future__ import annotations

import os
import random
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from mrl.algo import compute_policy_loss, describe_update
from mrl._compat.te import HAVE_TE, optimizer_states_for_checkpoint
from mrl.config.schema import BadSupport, Config, DType, OldLogprobs
from mrl.megatron import checkpoint_format, compat, minibatch, mismatch
from mrl.megatron.batch import RLBatch, WholeBatch, dp_share
from mrl.megatron.collectives import named
from mrl.megatron.collector import StepCollector
from mrl.megatron.export import check_model_keys
from mrl.megatron.lora import apply_lora, export_peft, is_adapter_key, load_peft_dir_into
from mrl.megatron.model import LOCAL_SPEC_ON_GPU, build_gpt_model, transformer_config, use_grouped_gemm
from mrl.megatron.optim import build_optimizer, wrap_ddp
from mrl.megatron.context_parallel import packed_rows, padded_len
from mrl.megatron.packing import Packing, pack_micro_batches
from mrl.megatron.parallel import Layout
from mrl.megatron.reference import ReferenceWeights
from mrl.megatron.train_step import MicroBatch, forward_backward
from mrl.megatron.weights import load_hf_into
from mrl.log import get_logger
from mrl.models import get_bridge
from mrl.models.checkpoint import HFCheckpoint
from mrl.routing.codec import RoutesCodec
from mrl.routing.replay import (RankSlice, ReplayDriver, ReplayMode, align_routes, routing_disagreement,
                                stage_moe_columns)
from mrl.routing.sampling_mask import SupportSpec, support_tensor, top_logprobs_to_request
from megatron.core import dist_checkpointing
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


log = get_logger(__name__)


def _host(values, dtype) -> torch.Tensor:
    """A sample's Python list (or array) as a CPU tensor, through numpy: ``torch.tensor`` of a list reads
    it element by element, several times slower, and the host builds a step's micro-batches while the
    device waits."""
    return torch.from_numpy(np.asarray(values, dtype=dtype))


def _mean(values: list[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0


class Policy:
    def __init__(self, cfg: Config, layout: Layout, hf_path: str, *, weights=None, device_init: bool = False):
        """``weights``: a reader with ``HFCheckpoint``'s interface (``SyntheticWeights``: drawn, no file); default
        the checkpoint at ``hf_path``. ``device_init``: parameters allocated on the GPU, not first in host memory."""
        self.cfg, self.layout = cfg, layout
        self.bridge = get_bridge(hf_path)
        self.tcfg = transformer_config(self.bridge, cfg.parallel, dtype=cfg.model.dtype, recompute=cfg.train.recompute,
                                       device_init=device_init)
        use_grouped_gemm(cfg.train.grouped_gemm)
        self.padded_vocab = self.bridge.padded_vocab(cfg.model.vocab_divisible_by, cfg.parallel.tp)
        model = build_gpt_model(self.bridge, self.tcfg, layout, self.padded_vocab,
                                fused_router_replay=cfg.train.fused_router_replay)
        load_hf_into(model, layout, self.bridge, weights or HFCheckpoint(hf_path), self.padded_vocab)
        self.lora = cfg.model.lora if cfg.model.lora.enabled else None
        """LoRA: the base weights are frozen and only the adapters train (DDP buckets and optimizer hold them)."""
        if self.lora is not None:
            apply_lora(model, layout, self.bridge, self.lora, seed=cfg.model.seed)
            if self.lora.init_from:
                load_peft_dir_into(model, layout, self.bridge, self.lora, self.lora.init_from)
        self.model = wrap_ddp(model, self.tcfg)
        t = cfg.train
        self.optimizer = build_optimizer([self.model], lr=cfg.algo.lr, clip_grad=t.clip_grad,
                                         weight_decay=t.weight_decay, bf16=self.tcfg.bf16,
                                         states_dtype=torch.bfloat16 if t.optimizer_states_dtype == DType.bf16
                                         else torch.float32)
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
        self.support_spec = self._support_spec()
        if t.packing and HAVE_TE:
            warnings.warn("train.packing with Transformer Engine uses the THD path (PackedSeqParams): it trains at "
                          "the padded path's speed on GPUs, but its logprobs have not yet been compared with "
                          "unpacked rows under TE; train.packing=false uses padded rows")
        if compat.HAS_CUDA and not HAVE_TE:
            warnings.warn(LOCAL_SPEC_ON_GPU)
        self.temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
        self.fused_logprob = cfg.train.fused_logprob
        self.reference = ReferenceWeights() if cfg.algo.kl_coef > 0 and not cfg.scoring.reference.enabled else None
        """KL reference weights swapped in for a forward per step; None: engines' (``RLBatch.ref_logp``)."""
        log.info("%s", describe_update(cfg.algo))
        self.collector = StepCollector(freeze=t.gc_freeze, interval=t.gc_interval)
        self.collector.after_setup()
        self.version = mismatch.WeightsVersion()
        """Which engine weight version these weights are (the loop reports each push): each token's lag."""
        self._replay_off_split: tuple[RLBatch, dict[str, float]] | None = None
        """``routing_metrics``' lag-0 sums with replay off, for the routing part of the same batch's step."""

    def capture_reference(self) -> None:
        """The current weights become the KL reference (the loop calls it when RL starts)."""
        if self.reference is not None:
            self.reference.capture(self.module)

    def _support_spec(self) -> SupportSpec | None:
        r, t = self.cfg.rollout, self.cfg.train
        if not t.sampling_mask:
            return None
        if r.temperature > 0 and r.top_k == -1 and r.top_p >= 1.0 and r.min_p <= 0.0:
            warnings.warn("train.sampling_mask=true has no effect: rollout samples from the whole vocabulary "
                          "(top_k=-1, top_p=1, min_p=0)")
        top_logprobs_to_request(temperature=r.temperature, top_k=r.top_k, top_logprobs_num=r.top_logprobs_num)
        return SupportSpec(temperature=r.temperature,
                           on_outside="raise" if t.bad_support == BadSupport.error else "drop")

    @property
    def module(self) -> torch.nn.Module:
        return self.model.module

    def export_lora(self, *, dst: int | None = 0, dtype: torch.dtype | None = None) -> tuple[dict, dict] | None:
        """LoRA runs: the adapter as HF PEFT (full CPU tensors by PEFT name, adapter_config dict) on global rank
        ``dst`` (every rank with None). Collective."""
        if self.lora is None:
            raise ValueError("export_lora: model.lora.rank is 0 (LoRA is off)")
        return export_peft(self.module, self.layout, self.bridge, self.lora, dst=dst, dtype=dtype)

    # -- batches ---------------------------------------------------------------------------------
    def micro_batches(self, batch: RLBatch, with_routes: bool, version: int | None = None,
                      samples: list[int] | None = None, size: int | None = None) -> tuple[list[MicroBatch], list[int]]:
        """This DP rank's slice of ``batch`` as equal-shape micro-batches; returns them and the indices (in
        the whole batch). ``batch`` is the whole batch or this DP rank's share of it: the same plan.
        ``version``: the trainer's (``WeightsVersion.current``); with ``batch.versions`` each token's lag behind
        it goes along as ``data["lag"]``. ``samples``: a mini-batch's whole-batch indices, DP rank 0's part
        first (``minibatch.mini_batch_samples``); None: the whole batch. ``size``: None = train.micro_batch_size."""
        dp, r, tp, cp = self.layout.dp.size, self.layout.dp.rank, self.layout.tp.size, self.layout.cp.size
        whole = WholeBatch.of(batch)
        samples = list(range(len(whole.lengths))) if samples is None else samples
        lengths = [whole.lengths[i] for i in samples]
        mine = [samples[j] for j in dp_share(len(lengths), dp, r)]
        size = size or self.cfg.train.micro_batch_size
        if self.cfg.train.packing:
            row_len, align = packed_rows(max(lengths), self.cfg.train.pack_max_len, tp=tp, cp=cp)
            plan = [([samples[j] for j in idx], pk) for idx, pk in
                    pack_micro_batches(lengths, dp_size=dp, dp_rank=r, row_len=row_len, device=compat.DEVICE,
                                       rows_per_micro_batch=size, align=align)]
        else:
            size = min(size, len(mine))
            while len(mine) % size:
                size -= 1
            plan = [(mine[j:j + size], None) for j in range(0, len(mine), size)]
        seq = padded_len(max(lengths), tp=tp, cp=cp)  # SP splits S over TP, CP into 2 * cp chunks
        return [self._micro_batch(batch, idx, pk, pk.width if pk else seq, with_routes, whole.support_width, version)
                for idx, pk in plan], mine

    def _micro_batch(self, batch: RLBatch, idx: list[int], pk: Packing | None, width: int,
                     with_routes: bool, support_width: int, version: int | None = None) -> MicroBatch:
        """Samples ``idx`` (of the whole batch) one per row of ``width`` tokens (the loss layout), packed into
        rows if ``pk``. ``valid`` (positions the engine routed) stays in the input's row layout, for routing
        metrics."""
        size = len(idx)
        ids = torch.zeros(size, width, dtype=torch.long)
        mask = torch.zeros(size, width - 1)
        behav, ref = torch.zeros(size, width - 1), None if batch.ref_logp is None else torch.zeros(size, width - 1)
        adv = torch.zeros(size, width - 1) if batch.token_advantages is not None else torch.zeros(size)
        valid = torch.zeros(size, width)  # rows the engine routed: every token but the last
        lag = torch.zeros(size, width - 1, dtype=torch.int32) if version is not None and batch.versions else None
        sup = batch.support if self.support_spec is not None else None
        support = [[[] for _ in range(width - 1)] for _ in idx] if sup is not None else None
        routes = []
        for b, i in enumerate(idx):
            at = batch.local(i)
            toks, p = batch.tokens[at], batch.prompt_lens[at]
            ids[b, :len(toks)] = _host(toks, np.int64)
            resp = len(toks) - p
            mask[b, p - 1:p - 1 + resp] = 1.0  # position t predicts token t + 1
            trained = batch.loss_mask[at] if batch.loss_mask is not None else None
            if trained is not None:
                if len(trained) != resp:
                    raise ValueError(f"sample {i}: loss mask of {len(trained)} tokens for {resp} response tokens")
                mask[b, p - 1:p - 1 + resp] = _host(trained, np.float32)
            behav[b, p - 1:p - 1 + resp] = _host(batch.behav_logp[at][:resp], np.float32)
            if ref is not None:  # the reference engines' logprobs, in the loss layout like behav
                ref[b, p - 1:p - 1 + resp] = _host(batch.ref_logp[at][:resp], np.float32)
            if batch.token_advantages is not None:  # per token, in the loss layout like behav
                adv[b, p - 1:p - 1 + resp] = _host(batch.token_advantages[at][:resp], np.float32)
            else:
                adv[b] = batch.advantages[at]
            if lag is not None:
                lag[b, p - 1:p - 1 + resp] = version - _host(batch.versions[at][:resp], np.int32)
            valid[b, :len(toks) - 1] = 1.0
            if with_routes:
                routes.append(align_routes(batch.routes[at], width, self.codec.num_experts))
            if sup is not None:
                for j, kept in enumerate(sup[at][:resp]):
                    if trained is not None and not trained[j]:
                        continue  # not sampled by the model: no support to keep
                    if not kept and self.cfg.train.bad_support == BadSupport.error:
                        raise ValueError(f"sample {i}, response token {j}: the engine's sampling support could not "
                                         "be rebuilt (too few top logprobs: raise rollout.top_logprobs_num); "
                                         "train.bad_support=mask takes such tokens out of the loss")
                    support[b][p - 1 + j] = kept
                    mask[b, p - 1 + j] *= float(bool(kept))
                if batch.support_log_mass is not None:
                    behav[b, p - 1:p - 1 + resp] -= _host(batch.support_log_mass[at][:resp], np.float32)
        routes_t = torch.from_numpy(np.stack(routes)) if with_routes else None
        support_t = (torch.stack([support_tensor(s, width=support_width) for s in support])
                     if sup is not None else None)
        if pk is not None:
            ids, valid = pk.pack_tokens(ids, 0), pk.pack_tokens(valid, 0.0)
            if routes_t is not None:
                routes_t = pk.pack_tokens(routes_t, torch.arange(self.codec.top_k) % self.codec.num_experts)
            if support_t is not None:
                support_t = pk.pack_predictions(support_t, -1)
        dev = compat.to_device  # asynchronous copies from pinned memory: the host keeps running ahead
        data = {"mask": dev(mask), "behav": dev(behav), "adv": dev(adv), "valid": dev(valid)}
        if lag is not None:
            data["lag"] = dev(lag)
        data |= {"ref": dev(ref)} if ref is not None else {}
        return MicroBatch(dev(ids), dev(routes_t) if routes_t is not None else None, data,
                          packing=pk, support=dev(support_t) if support_t is not None else None, samples=list(idx))

    # -- steps -----------------------------------------------------------------------------------
    def rl_step(self, batch: RLBatch, normalizer: float) -> dict[str, float]:
        """``algo.mini_batches * algo.ppo_epochs`` optimizer steps on ``batch`` (``normalizer``: the whole batch's
        loss normalizer, ``mrl.trainer.batch.build_batch``'s). pi_old comes from the weights before the first
        step: with ``algo.old_logprobs=recompute`` from a forward-only pass over the mini-batches after the
        first (the first one's is its own training forward, taken before any update), with ``engine`` from
        the engine's logprobs. Metrics: the loss metrics averaged over the steps (each step's clip fractions
        as ``minibatch/<j>/*`` when there are several), the engine gap and mismatch split from pi_old."""
        replay = self.cfg.train.replay and batch.routes is not None
        if self.support_spec is not None and batch.support is None:
            raise ValueError("train.sampling_mask=true but the batch carries no sampling supports (the rollout "
                             "must ask for top logprobs and rebuild them: sampling_mask.engine_support)")
        version = self.version.current
        algo = self.cfg.algo
        minis = minibatch.mini_batch_samples(len(WholeBatch.of(batch).lengths), self.layout.dp.size,
                                             algo.mini_batches)
        plans = [self.micro_batches(batch, replay, version, samples=s)[0] for s in minis]

        driver = self.replay if replay else None
        passes = dict(vocab_size=self.bridge.vocab_size, driver=driver, support=self.support_spec,
                      temperature=self.temperature, fused_logprob=self.fused_logprob)
        if self.reference is not None:  # same micro-batches and routes, the reference's weights
            self.reference.fill(self.model, self.layout, plans, passes)
        before = minibatch.old_logprobs(self, plans, passes, lambda k, size: self.micro_batches(
            batch, replay, version, samples=minis[k], size=size)[0])
        norms = minibatch.loss_normalizers(self, batch, plans, before, normalizer)

        def loss_fn_of(norm):
            def loss_fn(lp, mb):
                d = mb.data
                # no "old": the mini-batch's first forward before any update, so pi_old is its own logprobs
                return compute_policy_loss(lp, d["old"] if "old" in d else lp.detach(), d["behav"], d["adv"],
                                           d["mask"], algo, ref_logp=d.get("ref"), normalizer=norm)
            return loss_fn

        steps: list[tuple[list[dict[str, Any]], Any, bool]] = []  # each step's outputs, grad norm, success
        nonfinite = False
        for _ in range(algo.ppo_epochs):
            for k, mbs in enumerate(plans):
                self.model.zero_grad_buffer()
                self.optimizer.zero_grad()
                outs = forward_backward(self.model, self.layout, mbs, loss_fn=loss_fn_of(norms[k]),
                                        loss_scale=float(self.layout.dp.size), **passes)
                if before[k] is None and not steps:  # a forward before any update: pi_old of its later epochs
                    before[k] = outs
                    if algo.old_logprobs is OldLogprobs.recompute:
                        for mb, o in zip(mbs, outs):
                            mb.data["old"] = o["logprobs"]
                stepped = self._step_if_finite(outs)
                if stepped is None:  # no update, and none after it on this batch (as megatron skips an overflow)
                    nonfinite = True
                    break
                ok, grad_norm = stepped
                self.version.stepped(bool(ok))
                steps.append((outs, grad_norm, bool(ok)))
            if nonfinite:
                break
        if steps:
            self.scheduler.step(increment=1)  # once per rollout batch: train.lr_warmup_steps counts RL steps
        if nonfinite:
            return self._reduce({"update_ok": 0.0, "nonfinite_update": 1.0, "lr": self.optimizer.param_groups[0]["lr"]})
        metrics: dict[str, Any] = {"grad_norm": _mean([float(g or 0.0) for _, g, _ in steps]),
                                   "update_ok": float(all(ok for *_, ok in steps)),
                                   "nonfinite_update": 0.0, "lr": self.optimizer.param_groups[0]["lr"]}
        if self.support_spec is not None:
            metrics["support_unknown_tokens"] = float(WholeBatch.of(batch).support_unknown)
        if steps[0][0]:
            metrics |= minibatch.step_metrics([outs for outs, *_ in steps])
            # under the weights before the first step (with old_logprobs=engine: the first mini-batch's only)
            old_outs = [o for outs in before if outs is not None for o in outs]
            mbs = [mb for plan, outs in zip(plans, before) if outs is not None for mb in plan]
            metrics |= self._engine_gap(old_outs, mbs, "replay_on" if replay else "replay_off")
            metrics |= mismatch.split_sums(WholeBatch.of(batch).versions, old_outs, mbs, version, replay, algo)
            off, self._replay_off_split = self._replay_off_split, None
            if replay and off is not None and off[0] is batch:
                metrics |= off[1]
        return mismatch.ratios(self._reduce(metrics), self.layout.dp.size)

    def routing_metrics(self, batch: RLBatch) -> dict[str, float]:
        """Natural routing (RECORD, no replay) vs the engine's: disagreement rate, and the train-vs-engine
        logprob gap with replay off (the replay-on gap comes with the training step itself)."""
        if batch.routes is None:
            return {}
        version = self.version.current
        mbs, _ = self.micro_batches(batch, True, version)
        self.record.recorded.clear()
        outs = forward_backward(self.model, self.layout, mbs, vocab_size=self.bridge.vocab_size,
                                forward_only=True, driver=self.record, support=self.support_spec,
                                temperature=self.temperature, fused_logprob=self.fused_logprob)
        rates = []
        for mb, rec in zip(mbs, self.record.recorded):
            want = self.record.slice.tokens(mb.routes, mb.positions)  # [T_local, L_local, K] in router order
            got = torch.stack([t.to(want.device) for t in rec], 1)
            valid = self.record.slice.rows(mb.data["valid"], mb.positions) > 0
            rates.append(routing_disagreement(got, want, valid))
        metrics = {"routing_disagreement": _mean(rates)} if rates else {}
        if outs:
            metrics |= self._engine_gap(outs, mbs, "replay_off")
            split = mismatch.split_sums(WholeBatch.of(batch).versions, outs, mbs, version, False, None)
            self._replay_off_split = (batch, split) if split else None
        return self._reduce(metrics)

    def _engine_gap(self, outs, mbs, tag: str) -> dict[str, float]:
        """Mean over micro-batches of the mean |log pi_train - log pi_engine| and k3 KL over response
        tokens (0 for a micro-batch without any); one host sync for all of them."""
        rows = []
        for o, mb in zip(outs, mbs):
            m = mb.data["mask"] > 0
            d = torch.where(m, o["logprobs"] - mb.data["behav"], 0)  # log pi_train - log pi_engine
            n = m.sum().clamp(min=1)
            rows.append(torch.stack([d.abs().sum() / n, (d.exp() - 1 - d).sum() / n]))
        diffs, kls = torch.stack(rows).double().T.tolist()
        return {f"logprob_diff_{tag}": _mean(diffs), f"kl_engine_{tag}": _mean(kls)}

    def sft_step(self, tokens: list[list[int]], prompt_lens: list[int], lr: float) -> float:
        """Supervised warm start: mean NLL of the answer tokens, natural routing."""
        batch = RLBatch(tokens=tokens, prompt_lens=prompt_lens, behav_logp=[[0.0] * len(t) for t in tokens],
                        advantages=[0.0] * len(tokens), routes=None)
        mbs, _ = self.micro_batches(batch, False)
        total = sum(float(mb.data["mask"].sum()) for mb in mbs)
        box = torch.tensor([total], dtype=torch.float64, device=compat.DEVICE)  # NCCL reduces device tensors only
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
                                loss_scale=float(self.layout.dp.size), fused_logprob=self.fused_logprob)
        if self._step_if_finite(outs) is None:
            return float("nan")
        return self._reduce({"nll": _mean([float(o["nll"]) for o in outs])} if outs else {}).get("nll", 0.0)

    def _step_if_finite(self, outs: list[dict[str, Any]]) -> tuple[bool, Any] | None:
        """The optimizer step, unless the loss or a gradient is non-finite on some rank (then None, and no
        update on any rank). Megatron checks only with a grad scaler (fp16), and in fp32/bf16 would apply
        NaN gradients (a NaN norm passes its clip). One MAX all-reduce over the world: model-parallel and
        DP ranks skip or step together. A grad buffer's sum is finite iff all its elements are (an
        overflowing sum is as bad as an inf); after the DP reduce every rank's buffer still holds its own
        non-finite values, or the reduced ones.

        The verdict is read inside megatron's own step, as the found-inf flag of its ``prepare_grads``
        (the hook megatron gives its fp16 grad scaler): by then the host has queued megatron's gradient
        preparation, and the grad-norm sync follows at once. Read before the step, its host sync would
        leave the GPU idle for all of that host work instead of overlapping it."""
        vals = [o[k].reshape(()).float() for o in outs for k in ("pg_loss", "kl_ref", "nll") if k in o]
        vals += [b.grad_data.sum().float() for b in self.model.buffers + self.model.expert_parallel_buffers]
        bad = torch.zeros(1, device=compat.DEVICE)
        if vals:
            bad[0] = (~torch.stack([v.to(compat.DEVICE) for v in vals]).isfinite()).any()
        with named("the non-finite check before the optimizer step"):
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        verdict: dict[str, bool] = {}
        prepare = self.optimizer.prepare_grads

        def prepare_then_check() -> bool:
            found_inf = prepare()
            verdict["nonfinite"] = bool(bad.item())
            return found_inf or verdict["nonfinite"]

        self.optimizer.prepare_grads = prepare_then_check
        try:
            ok, grad_norm, _ = self.optimizer.step()
        finally:
            del self.optimizer.prepare_grads  # the class's own again
        self.collector.after_step()  # RL and SFT steps, taken or skipped: every rank counts the same
        # read here only when megatron's step returned before asking (its own found-inf): a second read
        # would wait for the optimizer's kernels for nothing
        if verdict["nonfinite"] if "nonfinite" in verdict else bool(bad.item()):
            return None
        return ok, grad_norm

    def _reduce(self, metrics: dict[str, float]) -> dict[str, float]:
        """Metrics of the ranks that have them, averaged, on every rank."""
        box = [None] * self.layout.world_size
        dist.all_gather_object(box, metrics)
        keys = sorted({k for m in box for k in m})
        return {k: _mean([m[k] for m in box if k in m]) for k in keys}

    # -- checkpoints -----------------------------------------------------------------------------
    # the optimizer state's layout: train.optimizer_checkpoint when saving, the checkpoint's own record
    # when loading (mrl/megatron/checkpoint_format.py)
    def _model_sharded(self, fmt: str) -> dict:
        """The model's sharded state dict; LoRA: the adapters only (the frozen base comes from model.hf_path)."""
        sd = self.module.sharded_state_dict(metadata=checkpoint_format.metadata(fmt))
        return {k: v for k, v in sd.items() if is_adapter_key(k)} if self.lora is not None else sd

    def _sharded(self, is_loading: bool, fmt: str) -> dict:
        model_sd = self._model_sharded(fmt)
        if is_loading:  # a fresh torch-Adam state has no entries to load into (megatron asserts it is not empty)
            for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                if hasattr(opt, "_init_optimizer_states_with_dummy_values"):
                    opt._init_optimizer_states_with_dummy_values()
        optim_sd = self.optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                     metadata=checkpoint_format.metadata(fmt))
        return {"model": model_sd, "optimizer": optim_sd}

    def save(self, path: str, *, async_save: bool = False):
        """Collective. ``async_save``: the model and optimizer shards are not written here; megatron's
        ``AsyncRequest`` for them is returned, to be scheduled at once (``mrl.trainer.async_save``: it stages
        the tensors to host memory then) and finalized later. The small per-rank files are written now."""
        os.makedirs(path, exist_ok=True)
        fmt = self.cfg.train.optimizer_checkpoint
        with optimizer_states_for_checkpoint(self.optimizer):  # TE's FusedAdam: no fp32 copies on the GPU
            sd = self._sharded(False, fmt)
        request = None
        if async_save:
            compat.checkpoint_writes_in_child()
            # megatron's own writer ("mcore"): its default, NVIDIA Resiliency Extension's, is not a dependency
            request = dist_checkpointing.save(sd, path, async_sharded_save=True, async_strategy="mcore")
        else:
            compat.checkpoint_writes_in_process()
            dist_checkpointing.save(sd, path)
        name, keys, pos, has_gauss, gauss = np.random.get_state()  # its key array as a tensor: weights_only loads it
        rng = {"python": random.getstate(), "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss,
                                                      gauss), "torch": torch.get_rng_state(),
               "scheduler": self.scheduler.state_dict()}
        torch.save(rng, os.path.join(path, f"rng_rank{self.layout.world_rank}.pt"))
        if self.reference is not None:
            self.reference.save(path, self.layout.world_rank)
        if self.layout.world_rank == 0:
            checkpoint_format.write_record(path, fmt, self.layout.config, self.layout.world_size)
        dist.barrier()
        return request

    def _check_checkpoint(self, path: str, fmt: str) -> None:
        """Fail with the mismatched tensors, not megatron's first shape error, when ``path`` was written for
        another model (collective)."""
        check_model_keys(path, self._model_sharded(fmt), self.layout, model=self.cfg.model.hf_path,
                         hint="point run_dir elsewhere or set train.resume=false")

    def load(self, path: str) -> None:
        fmt = checkpoint_format.read_format(path, self.layout.config)  # refuses a layout it cannot serve
        self._check_checkpoint(path, fmt)
        with optimizer_states_for_checkpoint(self.optimizer):  # read into host copies, scaled back on the GPU
            state = dist_checkpointing.load(self._sharded(True, fmt), path)
            if self.lora is None:
                self.module.load_state_dict(state["model"])
            else:
                missing, unexpected = self.module.load_state_dict(state["model"], strict=False)
                if unexpected or [k for k in missing if is_adapter_key(k)]:
                    raise RuntimeError(f"{path}: adapter state does not match the model: unexpected "
                                       f"{unexpected[:4]}, missing {[k for k in missing if is_adapter_key(k)][:4]}")
            self.optimizer.load_state_dict(state["optimizer"])
        rng = torch.load(os.path.join(path, f"rng_rank{self.layout.world_rank}.pt"), weights_only=True)
        random.setstate(rng["python"])
        name, keys, pos, has_gauss, gauss = rng["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
        torch.set_rng_state(rng["torch"])
        self.scheduler.load_state_dict(rng["scheduler"])
        if self.reference is not None and not self.reference.load(path, self.layout.world_rank):
            raise FileNotFoundError(f"algo.kl_coef={self.cfg.algo.kl_coef} but checkpoint {path} holds no reference "
                                    f"weights (reference_rank{self.layout.world_rank}.pt): it was saved without KL")
        dist.barrier()
