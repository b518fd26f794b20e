"""The RL loop, one process per trainer rank (``mrl train`` starts them with torchrun).

    rank 0 (controller)                              every rank
    ───────────────────                              ──────────
    engines (started here, or attached by URL)
    rollout process: prompts -> groups -> rewards -> buffer
    take a batch (staleness bound) -> advantages ──▶ RL step: replayed routes, policy loss, optimizer
                                                     every N steps: weight sync -> version + 1

Generation never waits for training (``train.mode=overlap``): engines keep generating while the
trainer computes; a sync pauses them briefly (in-flight requests are aborted and resumed on the new
weights; each token keeps the version that produced it). ``train.mode=sync`` is the baseline:
generate one batch, train, sync, repeat.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mrl.algo import compute_advantages, loss_normalizer, overlong_penalty
from mrl.buffer import Group
from mrl.config.load import load_resolved
from mrl.config.schema import BadRoutes, Config, LoopMode
from mrl.megatron.collectives import named
from mrl.megatron.parallel import destroy, init_parallel
from mrl.megatron.policy import Policy, RLBatch
from mrl.metrics import MetricsLog
from mrl.models.checkpoint import check_tokenizer
from mrl.rollout.restart import EngineRestarter
from mrl.routing.replay import check_routes
from mrl.weight_sync.executor import EngineEndpoint
from mrl.weight_sync.transport import EngineSync, make_transport


@dataclass
class LoopState:
    """What a checkpoint holds besides the weights: where the loop is."""

    step: int = 0
    version: int = 0
    prompt_index: int = 0
    buffered: list[Group] | None = None
    history: list[dict] | None = None


def build_batch(groups: list[Group], cfg: Config, with_routes: bool) -> tuple[RLBatch, float, dict]:
    """Advantages per group (+ DAPO overlong shaping), flattened in group order."""
    n = cfg.rollout.n_samples_per_prompt
    rewards = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float32)
    samples = [s for g in groups for s in g.samples]
    if cfg.algo.overlong_shaping:
        lengths = torch.tensor([len(s.response_ids) for s in samples])
        rewards = rewards + overlong_penalty(lengths, max_len=cfg.algo.max_response_len,
                                             buffer_len=cfg.algo.overlong_buffer_len)
    adv = compute_advantages(rewards, n, cfg.algo)
    batch = RLBatch(tokens=[s.tokens for s in samples], prompt_lens=[len(s.prompt_ids) for s in samples],
                    behav_logp=[list(s.response_logprobs) for s in samples], advantages=adv.tolist(),
                    routes=[s.routes for s in samples] if with_routes else None,
                    support=[s.support for s in samples] if cfg.train.sampling_mask else None,
                    support_log_mass=[s.support_log_mass for s in samples] if cfg.train.sampling_mask else None)
    masks = torch.zeros(len(samples), max(len(t) for t in batch.tokens))
    for i, s in enumerate(samples):
        masks[i, :len(s.response_ids)] = 1
    raw = [r for g in groups for r in g.rewards]
    info = {"reward": sum(raw) / len(raw), "success": sum(r >= 1.0 for r in raw) / len(raw),
            "response_len": sum(len(s.response_ids) for s in samples) / len(samples),
            "groups_without_signal": float(sum(max(g.rewards) == min(g.rewards) for g in groups))}
    return batch, float(loss_normalizer(masks, cfg.algo.aggregation)), info


class Controller:
    """Rank 0 only: the engines (started here, or attached by URL) and the rollout process that feeds
    the buffer from them (``mrl.rollout.service``: producer, rewards, buffer, evaluation)."""

    def __init__(self, cfg: Config, hf_path: str, policy: Policy, state: LoopState):
        from mrl.rollout.service import start_rollout

        self.cfg = cfg
        r = cfg.rollout
        self.engines = []
        urls = list(r.engine_urls) or self._discover(r)
        if not urls:
            from mrl.rollout.engine import engines_from_config

            self.engines = engines_from_config(r, hf_path, log_dir=os.path.join(cfg.run_dir, "engines"))
            for e in self.engines:
                e.start()
            for e in self.engines:
                e.wait_healthy()
            urls = [e.url for e in self.engines]
        self.endpoints = [EngineEndpoint(u, r.engine_tp) for u in urls]
        self.restarter = EngineRestarter(self.engines, r.restart_engines) if restarts_engines(cfg) else None
        self.codec = policy.codec
        self.rollout = start_rollout(cfg, hf_path, urls, policy.codec, {
            "eos": policy.bridge.hf_config.eos_token_id, "buffered": state.buffered,
            "prompt_index": state.prompt_index})

    @staticmethod
    def _discover(r) -> list[str]:
        """Engines announced by ``mrl engine`` on cluster engine nodes (``<dir>/<name>.url``)."""
        if not r.engine_url_dir:
            return []
        deadline = time.time() + 900
        while time.time() < deadline:
            found = sorted(f for f in os.listdir(r.engine_url_dir) if f.endswith(".url")) \
                if os.path.isdir(r.engine_url_dir) else []
            if len(found) >= r.num_engines:
                return [open(os.path.join(r.engine_url_dir, f)).read().strip() for f in found[:r.num_engines]]
            time.sleep(2)
        raise TimeoutError(f"rollout.engine_url_dir={r.engine_url_dir}: fewer than {r.num_engines} engines "
                           "announced themselves within 15 min")

    def take_batch(self, version: int) -> list[Group]:
        """``train.prompts_per_step`` groups from the buffer whose routes can be replayed."""
        t, codec = self.cfg.train, self.codec
        out: list[Group] = []
        while len(out) < t.prompts_per_step:
            try:
                got = self.rollout.take(t.prompts_per_step - len(out), version, timeout=t.batch_timeout_s)
            except TimeoutError as e:
                c = self.rollout.stats()["counts"]
                hint = (f"; algo.dynamic_sampling discarded {c['groups_no_signal']} groups whose samples all got "
                        "the same reward (the policy solves none or all of its prompts: warm-start it, or use a "
                        "reward with partial credit)") if c.get("groups_no_signal") else ""
                raise TimeoutError(f"{e}; producer counts {c}{hint}") from None
            for g in got:
                why = next((w for s in g.samples if (w := check_routes(
                    len(s.tokens), s.routes, num_moe_layers=len(codec.moe_layers), top_k=codec.top_k,
                    num_experts=codec.num_experts))), None) if t.replay else None
                if why is None:
                    out.append(g)
                elif t.bad_routes == BadRoutes.error:
                    raise ValueError(f"prompt {g.prompt.id}: {why} (train.bad_routes=error; 'drop' skips and counts)")
                else:
                    self.rollout.count("groups_bad_routes")
                    if t.mode == LoopMode.sync:  # overlap mode: the buffer already returned its credit
                        self.rollout.allow(1)
        return out

    def start(self, first_credits: int) -> None:
        self.rollout.start_producing(first_credits)

    def evaluate(self, n: int) -> float:
        """Greedy accuracy on held-out prompts."""
        return self.rollout.evaluate(n)

    def metrics(self) -> tuple[dict, dict, dict]:
        """(per-step scalars, staleness histogram, per-engine requests served) from the rollout side."""
        st = self.rollout.stats()
        return ({"dropped_stale": st["dropped_stale"], "buffered": st["buffered"],
                 **{f"rollout/{k}": v for k, v in st["counts"].items()},
                 **{f"rollout/{k}": st[k] for k in ("samples_failed", "samples_submitted", "samples_completed",
                                                    "engine_failures", "retries")}}, st["staleness"],
                st["served_by_engine"])

    def close(self) -> None:
        self.rollout.stop()
        for e in (self.restarter.engines if self.restarter else self.engines):
            e.stop()


def restarts_engines(cfg: Config) -> bool:
    """Dead engines are replaced: the job started them (not attached by URL) and may restart some."""
    r = cfg.rollout
    return r.restart_engines > 0 and not (r.engine_urls or r.engine_url_dir)


def _broadcast(obj, src: int = 0, what: str = "a loop object"):
    box = [obj]
    with named(f"broadcast of {what}", src=src):  # a hang or a dead rank names the op and the peer
        dist.broadcast_object_list(box, src=src)
    return box[0]


def _sft_warmup(cfg: Config, policy: Policy, hf_path: str, log: MetricsLog | None) -> None:
    """Supervised warm start on (prompt, reference answer + EOS), same Megatron trainer."""
    from tokenizers import Tokenizer

    from mrl.data import build_prompt_source

    t = cfg.train
    tok = Tokenizer.from_file(os.path.join(hf_path, "tokenizer.json"))
    eos = policy.bridge.hf_config.eos_token_id
    src = build_prompt_source(cfg.data)
    g = torch.Generator().manual_seed(cfg.seed)
    for step in range(t.sft_warmup_steps):
        idx = torch.randint(0, len(src), (t.sft_batch,), generator=g).tolist()
        prompts = [src.sample(i) for i in idx]
        p_ids = [tok.encode(p.text).ids for p in prompts]
        tokens = [p + tok.encode(p_.answer).ids + [eos] for p, p_ in zip(p_ids, prompts)]
        nll = policy.sft_step(tokens, [len(p) for p in p_ids], t.sft_lr)
        if log is not None:
            log.scalar("sft/nll", nll, step)
            log.progress(f"warm start {step + 1}/{t.sft_warmup_steps}  nll {nll:.3f}")


def _checkpoint_dir(cfg: Config) -> str:
    return os.path.join(cfg.run_dir, "checkpoints")


def _latest_checkpoint(cfg: Config) -> str | None:
    root = _checkpoint_dir(cfg)
    if not os.path.isdir(root):
        return None
    done = sorted((d for d in os.listdir(root) if os.path.isfile(os.path.join(root, d, "loop_state.pkl"))),
                  key=lambda d: int(d.split("_")[-1]))
    return os.path.join(root, done[-1]) if done else None


def _keep_off_engine_cores(cfg: Config) -> None:
    """CPU mode with ``rollout.cpus``: trainer ranks run on the other cores (if any are left)."""
    r = cfg.rollout
    if r.cpu_mode and r.cpus and not (r.engine_urls or r.engine_url_dir):
        rest = sorted(os.sched_getaffinity(0) - set(r.cpus))
        if rest:
            os.sched_setaffinity(0, rest)


def main(cfg: Config) -> int:
    hf_path = cfg.model.hf_path
    _keep_off_engine_cores(cfg)
    layout = init_parallel(cfg.parallel, seed=cfg.seed)
    rank0 = layout.world_rank == 0
    t = cfg.train
    policy = Policy(cfg, layout, hf_path)
    hc = policy.bridge.hf_config  # the loop encodes prompts with this model's tokenizer: a mismatch fails here
    check_tokenizer(hf_path, vocab_size=policy.bridge.vocab_size, special_ids={
        k: getattr(hc, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    state = LoopState()
    ckpt = _latest_checkpoint(cfg) if t.resume else None
    if ckpt:
        policy.load(ckpt)
        with open(os.path.join(ckpt, "loop_state.pkl"), "rb") as f:
            state = pickle.load(f)
    preempted = {"flag": False}
    signal.signal(signal.SIGUSR1, lambda *_: preempted.update(flag=True))  # Slurm: checkpoint + requeue

    log = MetricsLog(cfg.run_dir, total=t.steps, history=state.history) if rank0 else None
    if state.step == 0 and t.sft_warmup_steps:
        _sft_warmup(cfg, policy, hf_path, log)
    if state.step == 0:
        policy.capture_reference()  # KL reference (algo.kl_coef > 0): the policy RL starts from
    ctl = Controller(cfg, hf_path, policy, state) if rank0 else None
    endpoints = _broadcast(ctl.endpoints if rank0 else None)
    def channels(engines):  # also rebuilt without an engine that died (per-run group names: never reused)
        return make_transport(
            cfg.weight_sync.transport, model=policy.model, layout=layout, bridge=policy.bridge,
            padded_vocab=policy.padded_vocab, engines=engines, bucket_bytes=int(cfg.weight_sync.bucket_mb * (1 << 20)),
            export_dir=cfg.weight_sync.export_dir or os.path.join(cfg.run_dir, "weights"), config_src=hf_path,
            timeout_s=cfg.weight_sync.timeout_s, group_prefix=_broadcast(f"mrl-{os.urandom(4).hex()}"),
            dtype=cfg.rollout.engine_dtype)

    syncer = EngineSync(*channels(endpoints), layout, endpoints, rebuild=channels)
    syncer.connect()
    version = state.version
    if state.step > 0 or t.sft_warmup_steps:  # engines start from the HF checkpoint: bring them level
        version += 1
        syncer.sync(str(version))
    if rank0:
        ctl.start(t.max_inflight_groups if t.mode == LoopMode.overlap else t.prompts_per_step)
        if t.eval_every:
            log.scalar("eval/accuracy", ctl.evaluate(t.eval_prompts), state.step)

    step = state.step
    t_loop = time.monotonic()
    try:
        while step < t.steps:
            t0 = time.perf_counter()
            payload = None
            if rank0:
                groups = ctl.take_batch(version)
                batch, normalizer, info = build_batch(groups, cfg, t.replay)
                payload = (batch, normalizer, info)
            batch, normalizer, info = _broadcast(payload, what=f"the step-{step + 1} batch")
            t_gen = time.perf_counter() - t0
            m = {}
            if t.replay and t.routing_metrics_every and step % t.routing_metrics_every == 0:
                m |= policy.routing_metrics(batch)  # before the update: the weights the samples are judged by
            t_train = time.perf_counter()
            m |= policy.rl_step(batch, normalizer)
            m["train_seconds"] = time.perf_counter() - t_train
            step += 1
            m |= info
            if step % cfg.weight_sync.every_n_steps == 0:
                version += 1
                joining = _broadcast([EngineEndpoint(e.url, cfg.rollout.engine_tp) for e in ctl.restarter.take_ready()]
                                     if rank0 else None, what="the engines joining at this sync") \
                    if restarts_engines(cfg) else []
                t_drain = time.perf_counter()
                drained = ctl.rollout.drain(cfg.weight_sync.timeout_s) if rank0 else 0
                m["drain_seconds"] = time.perf_counter() - t_drain
                try:
                    if joining:  # restarted engines: new groups with them; this sync gives them the weights
                        syncer.add(joining)
                    rep = syncer.sync(str(version))
                finally:
                    if rank0:
                        ctl.rollout.undrain()
                if rank0 and ctl.restarter is not None:
                    alive = {e.url for e in syncer.engines}
                    for ep in joining:
                        if ep.url in alive:  # holds the weights of this version: rollouts may use it now
                            ctl.rollout.add_engine(ep.url)
                    ctl.restarter.replace(rep.dropped_engines)
                    m |= {"engines_restarted": float(ctl.restarter.restarted),
                          "engines_restart_failed": float(len(ctl.restarter.failed))}
                m["sync_aborted_requests"] = float(drained)
                if rep.bytes_sent:  # rank 0's buckets: the share sent straight from its params (no copy)
                    m["sync_in_place_fraction"] = rep.bytes_in_place / rep.bytes_sent
                m |= {"sync_seconds": rep.seconds, "sync_repaired": float(len(rep.repaired_from_disk)),
                      "engines_alive": float(len(syncer.engines)), "engines_dropped": float(len(syncer.dropped))}
            m |= {"wait_seconds": t_gen, "step_seconds": time.perf_counter() - t0, "version": version}
            if rank0:
                rm, staleness, served = ctl.metrics()
                m |= rm
                log.step(step, m, staleness=Counter({int(k): v for k, v in staleness.items()}),
                         extra={"rollout/served_by_engine": served, "wall_seconds": time.monotonic() - t_loop})
                if t.eval_every and step % t.eval_every == 0:
                    log.scalar("eval/accuracy", ctl.evaluate(t.eval_prompts), step)
            stop = _broadcast(preempted["flag"] or (t.stop_after is not None and step >= t.stop_after))
            if stop or (t.save_every and step % t.save_every == 0) or step == t.steps:
                _save(cfg, policy, ctl, LoopState(step=step, version=version), log)
            if stop:
                break
            if rank0 and t.mode == LoopMode.sync:  # after the checkpoint: nothing is in flight in it
                ctl.rollout.allow(t.prompts_per_step)
    finally:
        syncer.close()
        if rank0:
            ctl.close()
            log.close(cfg)
    destroy()
    return 0


def _save(cfg: Config, policy: Policy, ctl: Controller | None, state: LoopState, log: MetricsLog | None) -> None:
    path = os.path.join(_checkpoint_dir(cfg), f"step_{state.step}")
    policy.save(path)
    if ctl is not None:
        state.prompt_index, state.buffered = ctl.rollout.state()
        state.history = log.history
        with open(os.path.join(path, "loop_state.pkl.tmp"), "wb") as f:
            pickle.dump(state, f)
        os.replace(os.path.join(path, "loop_state.pkl.tmp"), os.path.join(path, "loop_state.pkl"))
    dist.barrier()


if __name__ == "__main__":
    sys.exit(main(load_resolved(sys.argv[1])))
