"""torchrun worker of bench/full_depth.py: the trainer of the full-depth job, built from synthetic weights.

    torchrun --nproc-per-node 1 bench/_full_depth_trainer.py --hf DIR --seed 0 --samples S.json --out T.json \\
        --steps 3 -- model.hf_path=DIR model.lora.rank=8 'model.lora.targets=[attention,experts]' ...
    ... --engine URL --steps 5 ...     # colocated: the engine beside it generates every step's batch

``Policy`` (``mrl train``'s trainer) with its HF tensors drawn by ``mrl.models.synthetic`` (the engine got the
same ones pushed), its parameters allocated on the GPU, LoRA on the config's targets. Then:

- Keep Routing at full depth: on the engine's batch (``--samples``, or the first colocated step's), forward
  passes with replay off (the routers' own choices, recorded) and on (the engine's experts replayed; forward
  hooks on the routers read back what was dispatched): route agreement per MoE layer and overall, and over
  the response tokens mean |log pi_train - log pi_engine|, k3 KL and the share of tokens with |dlogp| > 0.5;
- ``--steps`` LoRA GRPO steps (``Policy.rl_step``, replay on): offline on that batch again and again
  (advantages from a fixed reward), or colocated: generate (the engine, through mrl's rollout manager, the
  current adapter), release the engine's KV cache (``--release-kv``: SGLang's memory saver), train, resume
  the KV cache, export the adapter and load it into the engine (``AdapterSync``, from tensors); each phase timed;
- memory by component: frozen base, adapters (DDP buffer), grads, the optimizer's states (what the first step
  allocated), activations (a step's peak over what it started with), the process's peak, and the device's
  use (with an engine on it: both). Colocated: generate, release the KV cache, train, resume it, export and
  load the adapter: every step's phases in that order.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

import numpy as np
import torch

from mrl.algo.advantages import compute_advantages
from mrl.algo.aggregation import loss_normalizer
from mrl.config.load import compose
from mrl.megatron import compat
from mrl.megatron.batch import RLBatch
from mrl.megatron.parallel import destroy, init_parallel
from mrl.megatron.policy import Policy
from mrl.megatron.train_step import forward_backward
from mrl.models.synthetic import SyntheticWeights
from mrl.routing.replay import ReplayDriver, ReplayMode
from mrl.startup import LAUNCHED_AT

GIB = 1 << 30
PHASES = ("generate_s", "release_kv_s", "train_s", "resume_kv_s", "export_s", "push_s")
"""A step's phases, in order: what its ``step_s`` adds up."""


def _sync() -> None:
    if compat.HAS_CUDA:
        torch.cuda.synchronize()


def _alloc() -> float | None:
    return torch.cuda.memory_allocated() / GIB if compat.HAS_CUDA else None


def _device_used() -> float | None:
    """GiB in use on the device by every process (the engine's too), as the driver counts it."""
    if not compat.HAS_CUDA:
        return None
    free, total = torch.cuda.mem_get_info()
    return (total - free) / GIB


def _taps(model):
    """Forward hooks on every router: each call's dispatched expert set ``[T, K]`` (from its routing map)."""
    calls: list[torch.Tensor] = []
    handles = []
    for layer in model.decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if router is None:
            continue

        def hook(_m, _inp, out):
            rmap = out[1]
            k = int(rmap.sum(1).max())
            calls.append(rmap.float().topk(k, dim=1).indices.sort(1).values.detach())
        handles.append(router.register_forward_hook(hook))
    return calls, handles


def _agreement(got: torch.Tensor, want: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per MoE layer: (agreeing, total) token decisions; ``got``/``want`` ``[T, L, K]``, ``valid`` ``[T]``."""
    same = (got.sort(-1).values == want.to(got.device).long().sort(-1).values).all(-1)  # [T, L]
    v = valid.to(same.device).bool()
    return (same & v[:, None]).sum(0).double(), v.sum().double().expand(same.shape[1])


def mismatch(policy: Policy, batch: RLBatch) -> dict:
    """Replay off and on over ``batch``: route agreement per layer, |dlogp|, k3 KL, share |dlogp| > 0.5."""
    mbs, _ = policy.micro_batches(batch, True, policy.version.current)
    rs = policy.record.slice
    vocab = policy.bridge.vocab_size
    passes = dict(vocab_size=vocab, forward_only=True, temperature=policy.temperature,
                  fused_logprob=policy.fused_logprob)
    out = {}
    for mode in ("off", "on"):
        t = time.perf_counter()
        if mode == "off":
            drv = ReplayDriver(policy.tcfg, rs, ReplayMode.record)
            outs = forward_backward(policy.model, policy.layout, mbs, driver=drv, **passes)
            got = [torch.stack([x.to(compat.DEVICE) for x in rec], 1) for rec in drv.recorded]
            drv.close()
        else:
            calls, handles = _taps(policy.module)
            drv = ReplayDriver(policy.tcfg, rs, ReplayMode.replay)
            outs = forward_backward(policy.model, policy.layout, mbs, driver=drv, **passes)
            drv.close()
            for h in handles:
                h.remove()
            n = len(calls) // len(mbs)
            got = [torch.stack(calls[i * n:(i + 1) * n], 1) for i in range(len(mbs))]
        _sync()
        agree = total = 0
        diffs = []
        for mb, g, o in zip(mbs, got, outs):
            a, tot = _agreement(g, rs.tokens(mb.routes), rs.rows(mb.data["valid"]) > 0)
            agree, total = agree + a, total + tot
            m = mb.data["mask"] > 0
            diffs.append((o["logprobs"] - mb.data["behav"])[m].double())
        d = torch.cat(diffs)
        per_layer = (agree / total.clamp(min=1)).tolist()
        out[mode] = {"route_agreement": float(agree.sum() / total.sum()), "route_agreement_per_layer": per_layer,
                     "decisions": int(total.sum()), "tokens": int(d.numel()),
                     "mean_abs_dlogp": float(d.abs().mean()), "max_abs_dlogp": float(d.abs().max()),
                     "k3_kl": float((d.exp() - 1 - d).mean()),
                     "share_abs_dlogp_gt_0_5": float((d.abs() > 0.5).double().mean()),
                     "seconds": time.perf_counter() - t}
    return {"route_agreement_replay_off": out["off"]["route_agreement"],
            "route_agreement_replay_on": out["on"]["route_agreement"], "replay_off": out["off"], "replay_on": out["on"]}


def batch_of(tokens, prompt_lens, logprobs, routes, group: int, cfg) -> tuple[RLBatch, float]:
    """An RL batch of engine samples in groups of ``group``; reward: the share of even token ids in the
    response (a fixed function of the tokens, so groups differ and every step has a signal)."""
    rewards = torch.tensor([float(np.mean([t % 2 == 0 for t in tok[p:]])) for tok, p in zip(tokens, prompt_lens)])
    adv = compute_advantages(rewards, group, cfg.algo)
    batch = RLBatch(tokens=tokens, prompt_lens=prompt_lens, behav_logp=logprobs, advantages=adv.tolist(),
                    routes=routes)
    masks = torch.zeros(len(tokens), max(len(t) for t in tokens))
    for i, (t, p) in enumerate(zip(tokens, prompt_lens)):
        masks[i, :len(t) - p] = 1
    return batch, float(loss_normalizer(masks, cfg.algo.aggregation))


def components(policy: Policy) -> dict:
    """GiB of the frozen base, the adapters (DDP's parameter buffers) and their grads, as allocated."""
    m = policy.model
    bufs = [*m.buffers, *m.expert_parallel_buffers]
    base = sum(p.numel() * p.element_size() for p in policy.module.parameters() if not getattr(p, "lora_adapter", 0))
    return {"base_gib": base / GIB, "adapters_gib": sum(b.param_data.nbytes for b in bufs) / GIB,
            "grads_gib": sum(b.grad_data.nbytes for b in bufs) / GIB}


class Colocated:
    """The engine beside the trainer: mrl's rollout manager with the adapter router, the adapter sync, and
    the memory saver's release/resume of the KV cache."""

    def __init__(self, url: str, policy: Policy, cfg, a):
        from mrl.config.lora_engine import lora_engine_spec
        from mrl.rollout.lora import AdapterRouter
        from mrl.rollout.manager import RolloutManager
        from mrl.rollout.sample import SamplingSpec
        from mrl.sglang.client import EngineClient
        from mrl.weight_sync.adapter import AdapterSync

        self.url, self.policy, self.a = url, policy, a
        self.loop = asyncio.new_event_loop()
        self.client = EngineClient(url)
        self.mgr = RolloutManager([self.client], codec=policy.codec, adapters=AdapterRouter(),
                                  max_inflight_per_engine=a.prompts * a.group,
                                  sampling=SamplingSpec(max_new_tokens=a.new, temperature=1.0, ignore_eos=True))
        self.sync = AdapterSync([url], spec=lora_engine_spec(cfg), timeout_s=600.0, export_dir=a.adapter_dir)
        self.rng = random.Random(a.seed)

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def generate(self, step: int):
        v = self.policy.bridge.vocab_size
        prompts = [[self.rng.randrange(3, v) for _ in range(self.a.prompt_len)] for _ in range(self.a.prompts)]

        async def go():
            return await asyncio.gather(*(self.mgr.generate_group(p, n=self.a.group, group_id=step * 1000 + i)
                                          for i, p in enumerate(prompts)))
        samples = [s for g in self.run(go()) for s in g]
        bad = [s.error for s in samples if s.error]
        if bad:
            raise RuntimeError(f"{len(bad)} samples failed: {bad[:3]}")
        return samples

    def memory(self, release: bool) -> None:
        tags = ["kv_cache"]
        self.run(self.client.release_memory_occupation(tags) if release else self.client.resume_memory_occupation(tags))

    def push_adapter(self, version: int) -> dict:
        t = time.perf_counter()
        tensors, config = self.policy.export_lora(dst=0, dtype=torch.bfloat16)
        exported = time.perf_counter() - t
        report = self.sync.push(tensors, config, version)
        self.mgr.set_adapter(report.name, version)
        return {"export_s": exported, "push_s": time.perf_counter() - t - exported,
                "adapter_bytes": sum(x.numel() * x.element_size() for x in tensors.values())}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--samples", default=None, help="offline: the engine's batch (bench/full_depth.py wrote it)")
    ap.add_argument("--engine", default=None, help="colocated: the engine's URL (synthetic base pushed, LoRA on)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=4, help="colocated: prompts per step")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--release-kv", action="store_true", help="colocated: release the engine's KV cache in train")
    ap.add_argument("--adapter-dir", default=None, help="colocated: adapters by disk (a PEFT directory each)")
    ap.add_argument("--out", required=True)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    t0 = float(os.environ.get(LAUNCHED_AT) or time.time())
    rep: dict = {"marks_s": {}}

    def mark(name: str) -> None:
        _sync()
        rep["marks_s"][name] = time.time() - t0

    cfg = compose(a.overrides)
    layout = init_parallel(cfg.parallel, seed=cfg.seed)
    mark("trainer_imported")
    weights = SyntheticWeights(a.hf, seed=a.seed, device="cuda" if compat.HAS_CUDA else "cpu")
    t = time.perf_counter()
    policy = Policy(cfg, layout, a.hf, weights=weights, device_init=True)
    _sync()
    rep["policy_build_s"] = time.perf_counter() - t
    mark("policy_ready")
    rep["num_hidden_layers"] = policy.bridge.num_layers
    rep["memory"] = {**components(policy), "allocated_after_build_gib": _alloc(), "device_used_after_build_gib":
                     _device_used()}
    rep["lora"] = {"rank": cfg.model.lora.rank, "targets": list(cfg.model.lora.targets),
                   "trainable_params": sum(p.numel() for p in policy.module.parameters() if p.requires_grad)}
    colo = Colocated(a.engine, policy, cfg, a) if a.engine else None
    if colo is None:
        with open(a.samples) as f:
            sj = json.load(f)
        dt = np.uint8 if policy.codec.num_experts <= 256 else np.int32
        fixed = batch_of(sj["sequences"], sj["prompt_lens"], sj["engine_logprobs"],
                         [np.asarray(r, dtype=dt) for r in sj["routes"]], a.group, cfg)
        rep["mismatch"] = mismatch(policy, fixed[0])
        mark("mismatch_done")
    steps = []
    for step in range(a.steps):
        ph: dict = {}
        if compat.HAS_CUDA:
            torch.cuda.reset_peak_memory_stats()
        if colo is not None:
            t = time.perf_counter()
            samples = colo.generate(step)
            ph["generate_s"] = time.perf_counter() - t
            ph["tokens"] = sum(len(s.tokens) for s in samples)
            ph["response_tokens"] = sum(len(s.response_ids) for s in samples)
            ph["generate_tokens_per_s"] = ph["response_tokens"] / ph["generate_s"]
            batch, norm = batch_of([s.tokens for s in samples], [len(s.prompt_ids) for s in samples],
                                   [list(s.response_logprobs) for s in samples], [s.routes for s in samples],
                                   a.group, cfg)
            if step == 0:
                rep["mismatch"] = mismatch(policy, batch)
            if a.release_kv:
                t = time.perf_counter()
                before = _device_used()
                colo.memory(release=True)
                ph["release_kv_s"] = time.perf_counter() - t
                ph["kv_released_gib"] = before - _device_used() if before is not None else None
        else:
            batch, norm = fixed
            ph["tokens"] = sum(len(x) for x in batch.tokens)
        before = _alloc()
        t = time.perf_counter()
        metrics = policy.rl_step(batch, norm)
        _sync()
        ph["train_s"] = time.perf_counter() - t
        ph["train_tokens_per_s"] = ph["tokens"] / ph["train_s"]
        ph["grad_norm"], ph["update_ok"] = metrics.get("grad_norm"), metrics.get("update_ok")
        ph["logprob_diff_replay_on"] = metrics.get("logprob_diff_replay_on")
        if compat.HAS_CUDA:
            ph["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
            ph["activations_gib"] = ph["peak_allocated_gib"] - before
            ph["allocated_after_gib"] = _alloc()
            ph["device_used_gib"] = _device_used()
            if step == 0:  # Adam's states (and fp32 masters) appear with the first step
                rep["memory"]["optimizer_gib"] = ph["allocated_after_gib"] - before
        if colo is not None:
            if a.release_kv:  # back before the adapter loads: the engine is whole whenever it takes a request
                t = time.perf_counter()
                colo.memory(release=False)
                ph["resume_kv_s"] = time.perf_counter() - t
            ph |= colo.push_adapter(step + 1)
            ph["adapter_sync_ms"] = 1000 * (ph["export_s"] + ph["push_s"])
        ph["step_s"] = sum(ph.get(k, 0.0) for k in PHASES)
        steps.append(ph)
        if step == 0:
            mark("first_step")
        print(f"[full_depth] step {step}: " + json.dumps({k: round(v, 4) if isinstance(v, float) else v
                                                          for k, v in ph.items()}), flush=True)
    rep["steps"] = steps
    rep["time_to_first_step_s"] = rep["marks_s"].get("first_step")
    if compat.HAS_CUDA:
        rep["peak_memory_gib"] = max([s["peak_allocated_gib"] for s in steps]
                                     + [rep["memory"]["allocated_after_build_gib"]])
        rep["memory"]["activations_gib"] = max(s["activations_gib"] for s in steps)
        rep["device_used_peak_gib"] = max(s["device_used_gib"] for s in steps)
    if colo is not None:
        ms = [s["adapter_sync_ms"] for s in steps]
        rep["adapter_sync_ms"] = float(np.median(ms))
        rep["adapter_bytes"] = steps[0]["adapter_bytes"]
    with open(a.out, "w") as f:
        json.dump(rep, f, indent=1)
    destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
