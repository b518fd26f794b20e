"""The RL loop, one process per trainer rank (``mrl train`` starts them with torchrun, entering through
``mrl.jobs.train``).

    loop = Loop(cfg)      # model, optimizer, the checkpoint to resume from, rank 0's metrics log
    loop.run()            # warm start, engines + rollout process, then per step:
                          # take batch, train step, maybe sync weights, log, maybe checkpoint

    rank 0 (``Controller``)                          every rank
    ───────────────────────                          ──────────
    engines (started here, or attached by URL)
    rollout process: prompts -> groups -> rewards -> buffer
    take a batch (staleness bound) -> advantages ──▶ RL step: replayed routes, policy loss, optimizer
                                                     every N steps: weight sync -> version + 1

Generation never waits for training (``train.mode=overlap``): engines keep generating while the
trainer computes; a sync pauses them briefly (in-flight requests are aborted and resumed on the new
weights; each token keeps the version that produced it). ``train.mode=sync`` is the baseline:
generate one batch, train, sync, repeat.

LoRA runs (``model.lora.rank > 0``) train adapters only; the engines keep their base weights and get each
version as an adapter (``AdapterChannel``: no weight-update group, no pause, no drain), and the run ends
by writing the final adapter as a PEFT directory (``run_dir/adapter``).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import shutil
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from mrl.algo import compute_advantages, loss_normalizer, overlong_penalty
from mrl.rollout.buffer import Group
from mrl.config.load import load_resolved
from mrl.config.lora_engine import lora_engine_spec
from mrl.config.schema import BadRoutes, Config, LoopMode, WeightTransport
from mrl.data import Prompt
from mrl.megatron.batch_scatter import BatchScatter
from mrl.megatron.collectives import broadcast_object
from mrl.megatron.parallel import destroy, init_parallel
from mrl.megatron.policy import Policy, RLBatch
from mrl.metrics import MetricsLog
from mrl.models.checkpoint import check_tokenizer
from mrl.models.peft import save_peft
from mrl.process import LOOP_STATE_FILE
from mrl.engine.launcher import launch_job_engines, start_job_engines
from mrl.engine.restart import EngineRestarter, kill_engines
from mrl.rollout.sample import Sample
from mrl.routing.replay import check_routes
from mrl.weight_sync.lora import AdapterChannel
from mrl.weight_sync.sync import EngineSync, check_finite_weights, make_transport, verify_engines
from mrl.weight_sync.transport import EngineEndpoint


@dataclass
class LoopState:
    """What a checkpoint holds besides the weights: where the loop is."""

    step: int = 0
    version: int = 0
    prompt_index: int = 0
    buffered: list[Group] | None = None
    history: list[dict] | None = None
    redo_prompts: list[int] | None = None
    """Prompts drawn whose groups were unfinished at the checkpoint: generated first after a resume."""


class NonFiniteUpdates(RuntimeError):
    """``train.max_nonfinite_steps`` optimizer steps in a row were skipped for a non-finite loss or gradient."""


class NonFiniteSteps:
    """Counts the RL steps whose update was skipped (``Policy.rl_step``: a non-finite loss or gradient on
    some rank); ``limit`` of them in a row stop the run (0 = never)."""

    def __init__(self, limit: int):
        self.limit, self.total, self.in_a_row = limit, 0, 0

    def update(self, step: int, m: dict) -> dict:
        if m.get("nonfinite_update"):
            self.total += 1
            self.in_a_row += 1
        else:
            self.in_a_row = 0
        if self.limit and self.in_a_row >= self.limit:
            raise NonFiniteUpdates(
                f"train.max_nonfinite_steps={self.limit}: steps {step - self.in_a_row + 1}-{step} all had a non-finite "
                "(NaN/Inf) loss or gradient on some trainer rank and were skipped, so the weights have not changed "
                f"since step {step - self.in_a_row}; look at the rewards and advantages of these steps, or lower "
                "algo.lr. The last checkpoint holds finite weights: rerun to resume from it.")
        return {"nonfinite_steps": float(self.total)}


def _state_types() -> dict[str, type]:
    return {c.__name__: c for c in (LoopState, Group, Sample, Prompt)}


def state_to_json(x):
    """The loop state as plain JSON: the dataclasses above tagged by name, numpy arrays (routes) as
    dtype + shape + base64 bytes. JSON, not pickle: loading a checkpoint runs no code from it."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        if type(x).__name__ not in _state_types():
            raise TypeError(f"loop state: {type(x).__name__} is not one of {sorted(_state_types())}")
        return {"__type__": type(x).__name__, **{f.name: state_to_json(getattr(x, f.name))
                                                for f in dataclasses.fields(x)}}
    if isinstance(x, np.ndarray):
        return {"__ndarray__": x.dtype.str, "shape": list(x.shape),
                "data": base64.b64encode(np.ascontiguousarray(x).tobytes()).decode()}
    if isinstance(x, dict):
        return {str(k): state_to_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [state_to_json(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    if x is None or isinstance(x, (str, int, float, bool)):
        return x
    raise TypeError(f"loop state: cannot store a {type(x).__name__} as JSON")


def state_from_json(x):
    """Inverse of ``state_to_json``; only the tagged dataclasses and numeric arrays are rebuilt."""
    if isinstance(x, list):
        return [state_from_json(v) for v in x]
    if not isinstance(x, dict):
        return x
    if "__ndarray__" in x:
        dt = np.dtype(x["__ndarray__"])
        if dt.kind not in "biuf":
            raise ValueError(f"loop state: array of dtype {dt} (only numbers are stored)")
        return np.frombuffer(base64.b64decode(x["data"]), dtype=dt).reshape(x["shape"]).copy()
    if "__type__" in x:
        cls = _state_types().get(x["__type__"])
        if cls is None:
            raise ValueError(f"loop state: unknown type {x['__type__']!r}")
        init = {f.name for f in dataclasses.fields(cls) if f.init}
        return cls(**{k: state_from_json(v) for k, v in x.items() if k in init})
    return {k: state_from_json(v) for k, v in x.items()}


def build_batch(groups: list[Group], cfg: Config, with_routes: bool) -> tuple[RLBatch, float, dict]:
    """Advantages per group (+ DAPO overlong shaping), flattened in group order."""
    n = cfg.rollout.n_samples_per_prompt
    rewards = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float32)
    samples = [s for g in groups for s in g.samples]
    if cfg.algo.overlong_shaping:
        lengths = torch.tensor([len(s.response_ids) for s in samples])
        rewards = rewards + overlong_penalty(lengths, max_len=cfg.algo.max_response_len,
                                             buffer_len=cfg.algo.overlong_buffer_len)
    sizes = [len(g.rewards) for g in groups]  # whole groups today; each normalized by its own size regardless
    adv = (compute_advantages(rewards, n, cfg.algo) if set(sizes) == {n}
           else torch.cat([compute_advantages(r, len(r), cfg.algo) for r in rewards.split(sizes)]))
    batch = RLBatch(tokens=[s.tokens for s in samples], prompt_lens=[len(s.prompt_ids) for s in samples],
                    behav_logp=[list(s.response_logprobs) for s in samples], advantages=adv.tolist(),
                    routes=[s.routes for s in samples] if with_routes else None,
                    support=[s.support for s in samples] if cfg.train.sampling_mask else None,
                    support_log_mass=[s.support_log_mass for s in samples] if cfg.train.sampling_mask else None,
                    # multi-turn episodes: observation tokens (mask 0) are context, never trained
                    loss_mask=[list(s.loss_mask) or [1] * len(s.response_ids) for s in samples]
                    if any(0 in s.loss_mask for s in samples) else None,
                    versions=[list(s.versions) for s in samples])
    masks = torch.zeros(len(samples), max(len(t) for t in batch.tokens))
    for i, s in enumerate(samples):  # the normalizer counts trained tokens only (token-mean aggregations)
        masks[i, :len(s.response_ids)] = torch.tensor(s.loss_mask, dtype=torch.float32) if s.loss_mask else 1
    raw = [r for g in groups for r in g.rewards]
    info = {"reward": sum(raw) / len(raw), "success": sum(r >= 1.0 for r in raw) / len(raw),
            "response_len": sum(len(s.response_ids) for s in samples) / len(samples),
            "groups_without_signal": float(sum(max(g.rewards) == min(g.rewards) for g in groups)),
            "batch_tokens": float(sum(len(s.tokens) for s in samples))}  # prompt + response: what the step trains on
    return batch, float(loss_normalizer(masks, cfg.algo.aggregation)), info


class Controller:
    """Rank 0's duties: the metrics log, the engines (started here, or attached by URL) and the rollout
    process that feeds the buffer from them (``mrl.rollout.service``: producer, rewards, buffer,
    evaluation). The other ranks hold an ``OtherRank`` with the same methods, doing nothing."""

    def __init__(self, cfg: Config, state: LoopState, engines: list | None = None):
        self.cfg = cfg
        self.log = MetricsLog(cfg.run_dir, total=cfg.train.steps, history=state.history, cfg=cfg)
        self.engines = list(engines or [])  # started already (``launch_job_engines``)
        self.restarter: EngineRestarter | None = None
        self.rollout = None

    def start_engines(self, hf_path: str, policy: Policy, state: LoopState) -> list[EngineEndpoint]:
        """Start or find the engines, then the rollout process; the endpoints the weight sync serves."""
        from mrl.rollout.service import start_rollout

        r = self.cfg.rollout
        urls = list(r.engine_urls) or self._discover(r)
        if not urls:

            self.engines = self.engines or start_job_engines(self.cfg)
            for e in self.engines:
                e.wait_healthy()
            urls = [e.url for e in self.engines]
        self.restarter = EngineRestarter(self.engines, r.restart_engines) if restarts_engines(self.cfg) else None
        self.codec = policy.codec
        self.rollout = start_rollout(self.cfg, hf_path, urls, policy.codec, {
            "eos": policy.bridge.hf_config.eos_token_id, "vocab_size": policy.bridge.vocab_size,
            "buffered": state.buffered,
            "prompt_index": state.prompt_index, "redo_prompts": state.redo_prompts or []})
        return [EngineEndpoint(u, r.engine_tp) for u in urls]

    @staticmethod
    def _discover(r) -> list[str]:
        """Engines announced by ``mrl engine`` on cluster engine nodes (``<dir>/<name>.url``)."""
        from mrl.cluster.engines import job_addresses, read_urls

        if not r.engine_url_dir:
            return []
        allowed = job_addresses()
        deadline = time.time() + 900
        while time.time() < deadline:
            found = list(read_urls(r.engine_url_dir, allowed).values())
            if len(found) >= r.num_engines:
                return found[:r.num_engines]
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

    def next_batch(self, version: int) -> tuple[RLBatch, float, dict]:
        """The step's batch with its advantages, loss normalizer and reward figures."""
        return build_batch(self.take_batch(version), self.cfg, self.cfg.train.replay)

    def start_producing(self, first_credits: int, step: int) -> None:
        self.rollout.start_producing(first_credits)
        self.maybe_evaluate(step, first=True)

    def maybe_evaluate(self, step: int, first: bool = False) -> None:
        """Greedy accuracy on held-out prompts every ``train.eval_every`` steps."""
        t = self.cfg.train
        if t.eval_every and (first or step % t.eval_every == 0):
            self.log.scalar("eval/accuracy", self.rollout.evaluate(t.eval_prompts), step)

    def warm_start_progress(self, step: int, nll: float) -> None:
        self.log.scalar("sft/nll", nll, step)
        total = self.cfg.train.sft_warmup_steps
        self.log.progress(f"warm start {step + 1}/{total}  nll {nll:.3f}", step + 1, total)

    def joining_engines(self) -> list[EngineEndpoint]:
        """Restarted engines that are healthy now: they join at this sync."""
        return [EngineEndpoint(e.url, self.cfg.rollout.engine_tp) for e in self.restarter.take_ready()]

    def drain(self) -> int:
        """Abort the engines' in-flight requests and hold new ones (resumed after the sync); how many."""
        return self.rollout.drain(self.cfg.weight_sync.timeout_s)

    def set_adapter(self, name: str, version: int) -> None:
        """LoRA: new requests name adapter ``name``, loaded on every engine (their tokens get ``version``)."""
        self.rollout.set_adapter(name, version)

    def undrain(self) -> None:
        self.rollout.undrain()

    def after_sync(self, alive: list[EngineEndpoint], joining: list[EngineEndpoint], dropped: list[str]) -> dict:
        """Joined engines take rollouts now (they hold this version); dropped ones get replacements."""
        if self.restarter is None:
            kill_engines(self.engines, dropped)  # a hung one would hold its cores to the end of the run
            return {}
        urls = {e.url for e in alive}
        for ep in joining:
            if ep.url in urls:
                self.rollout.add_engine(ep.url)
        self.restarter.replace(dropped)
        return {"engines_restarted": float(self.restarter.restarted),
                "engines_restart_failed": float(len(self.restarter.failed))}

    def log_step(self, step: int, m: dict, wall_seconds: float) -> None:
        """The step's metrics with the rollout side's counters, then maybe an evaluation."""
        st = self.rollout.stats()
        m = m | {"dropped_stale": st["dropped_stale"], "buffered": st["buffered"],
                 **{f"rollout/{k}": v for k, v in st["counts"].items()},
                 **{f"rollout/{k}": st[k] for k in ("samples_failed", "samples_submitted", "samples_completed",
                                                    "engine_failures", "retries")}}
        self.log.step(step, m, staleness=Counter({int(k): v for k, v in st["staleness"].items()}),
                      extra={"rollout/served_by_engine": st["served_by_engine"], "wall_seconds": wall_seconds})
        self.maybe_evaluate(step)

    def allow(self, n: int) -> None:
        """Sync mode: let the producer generate the next batch."""
        self.rollout.allow(n)

    def save_loop_state(self, path: str, state: LoopState) -> None:
        state.prompt_index, state.buffered, state.redo_prompts = self.rollout.state()
        state.history = self.log.history
        sync_tree(path)  # every rank's shards on disk before the marker: a crash never leaves a "complete" hole
        final = os.path.join(path, LOOP_STATE_FILE)
        with open(final + ".tmp", "w") as f:
            json.dump(state_to_json(state), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(final + ".tmp", final)  # its presence marks the checkpoint complete
        sync_tree(path, files=False)
        prune_checkpoints(_checkpoint_dir(self.cfg), self.cfg.train.keep_checkpoints)

    def close(self) -> None:
        if self.rollout is not None:
            self.rollout.stop()
        for e in self.engines:  # replacements included: the restarter appends them to this list
            e.stop()
        self.log.close(self.cfg)


class OtherRank:
    """Ranks > 0: the controller's duties belong to rank 0; the loop calls the same methods here."""

    def start_engines(self, hf_path: str, policy: Policy, state: LoopState) -> None:
        return None

    def next_batch(self, version: int) -> None:
        return None

    def joining_engines(self) -> None:
        return None

    def drain(self) -> int:
        return 0

    def set_adapter(self, name: str, version: int) -> None:
        pass

    def after_sync(self, alive: list[EngineEndpoint], joining: list[EngineEndpoint], dropped: list[str]) -> dict:
        return {}

    def start_producing(self, first_credits: int, step: int) -> None:
        pass

    def warm_start_progress(self, step: int, nll: float) -> None:
        pass

    def undrain(self) -> None:
        pass

    def log_step(self, step: int, m: dict, wall_seconds: float) -> None:
        pass

    def allow(self, n: int) -> None:
        pass

    def save_loop_state(self, path: str, state: LoopState) -> None:
        pass

    def close(self) -> None:
        pass


def restarts_engines(cfg: Config) -> bool:
    """Dead engines are replaced: the job started them (not attached by URL) and may restart some."""
    r = cfg.rollout
    return r.restart_engines > 0 and not (r.engine_urls or r.engine_url_dir)


def _sft_warmup(cfg: Config, policy: Policy, hf_path: str, duties: Controller | OtherRank) -> None:
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
        if hasattr(src, "warm_start_tokens"):  # a multi-turn task: its whole solving conversation
            tokens, p_lens = map(list, zip(*(src.warm_start_tokens(p, tok, eos) for p in prompts)))
        else:
            p_ids = [tok.encode(p.text).ids for p in prompts]
            tokens = [p + tok.encode(p_.answer).ids + [eos] for p, p_ in zip(p_ids, prompts)]
            p_lens = [len(p) for p in p_ids]
        nll = policy.sft_step(tokens, p_lens, t.sft_lr)
        duties.warm_start_progress(step, nll)


def _checkpoint_dir(cfg: Config) -> str:
    return os.path.join(cfg.run_dir, "checkpoints")


def _latest_checkpoint(cfg: Config) -> str | None:
    root = _checkpoint_dir(cfg)
    if not os.path.isdir(root):
        return None
    done = sorted((d for d in os.listdir(root) if os.path.isfile(os.path.join(root, d, LOOP_STATE_FILE))),
                  key=lambda d: int(d.split("_")[-1]))
    old = [d for d in os.listdir(root) if os.path.isfile(os.path.join(root, d, "loop_state.pkl"))]
    if old and not done:  # never unpickled: a pickle in a checkpoint runs whatever code it names
        raise ValueError(f"{root}: checkpoints {sorted(old)} hold a pickled loop state (loop_state.pkl, written by "
                         f"an older mrl), which is no longer loaded; start afresh with train.resume=false or "
                         "another run_dir")
    return os.path.join(root, done[-1]) if done else None


def sync_tree(path: str, *, files: bool = True) -> None:
    """fsync every file under ``path`` (written by any rank: the page cache is the inode's), then the
    directories, so their entries are durable too."""
    for root, dirs, names in os.walk(path, topdown=False):
        for name in (names if files else []):
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def prune_checkpoints(root: str, keep: int) -> list[str]:
    """Delete the complete checkpoints under ``root`` older than the newest ``keep`` (0: none deleted).
    A directory without its marker (being written, or left by a crash) is not counted and not touched."""
    if keep <= 0 or not os.path.isdir(root):
        return []
    done = sorted((d for d in os.listdir(root) if os.path.isfile(os.path.join(root, d, LOOP_STATE_FILE))),
                  key=lambda d: int(d.split("_")[-1]))
    old = done[:-keep]
    for d in old:
        shutil.rmtree(os.path.join(root, d))
    return old


def _keep_off_engine_cores(cfg: Config) -> None:
    """CPU mode with ``rollout.cpus``: trainer ranks run on the other cores (if any are left)."""
    r = cfg.rollout
    if r.cpu_mode and r.cpus and not (r.engine_urls or r.engine_url_dir):
        rest = sorted(os.sched_getaffinity(0) - set(r.cpus))
        if rest:
            os.sched_setaffinity(0, rest)


class Loop:
    """The RL loop on one trainer rank. Rank 0's extra work (engines, rollout process, metrics) sits
    behind ``self.duties``; every rank runs the same steps and collectives."""

    def __init__(self, cfg: Config, engines: list | None = None):
        """``engines``: rank 0's, started by the caller already (``launch_job_engines``); None: started here."""
        self.cfg, t = cfg, cfg.train
        self.hf_path = cfg.model.hf_path
        _keep_off_engine_cores(cfg)
        self.layout = init_parallel(cfg.parallel, seed=cfg.seed)
        if engines is None:
            engines = launch_job_engines(cfg) if self.layout.world_rank == 0 else []
        self.policy = Policy(cfg, self.layout, self.hf_path)
        hc = self.policy.bridge.hf_config  # the loop encodes prompts with this model's tokenizer: a mismatch fails here
        check_tokenizer(self.hf_path, vocab_size=self.policy.bridge.vocab_size, special_ids={
            k: getattr(hc, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
        self.state = LoopState()
        ckpt = _latest_checkpoint(cfg) if t.resume else None
        if ckpt:
            self.policy.load(ckpt)
            with open(os.path.join(ckpt, LOOP_STATE_FILE)) as f:
                self.state = state_from_json(json.load(f))
            if self.layout.world_rank == 0:
                print(f"[mrl] resuming from {ckpt} (step {self.state.step} of {t.steps})", flush=True)
        self.step, self.version = self.state.step, self.state.version
        self.preempted = False
        signal.signal(signal.SIGUSR1, self._on_usr1)  # Slurm: checkpoint + requeue
        self.duties = Controller(cfg, self.state, engines) if self.layout.world_rank == 0 else OtherRank()
        self.syncer: EngineSync | AdapterChannel | None = None
        self.nonfinite = NonFiniteSteps(t.max_nonfinite_steps)
        # each step's batch goes from rank 0 to each rank as its DP rank's share only
        self.batches = BatchScatter(dp_rank=self.layout.dp.rank, dp_size=self.layout.dp.size, group=dist.group.WORLD)

    def run(self) -> int:
        t = self.cfg.train
        self.warm_start()
        self.connect_engines()
        t_loop = time.monotonic()
        try:
            while self.step < t.steps:
                t0 = time.perf_counter()
                batch, normalizer, info = self.take_batch()
                m = {"wait_seconds": time.perf_counter() - t0} | self.train_step(batch, normalizer) | info
                m |= self.nonfinite.update(self.step + 1, m)
                self.step += 1
                if self.step % self.cfg.weight_sync.every_n_steps == 0:
                    m |= self.sync_weights()
                m |= {"step_seconds": time.perf_counter() - t0, "version": self.version}
                self.duties.log_step(self.step, m, time.monotonic() - t_loop)
                if self.maybe_checkpoint():
                    break
                if t.mode == LoopMode.sync:  # after the checkpoint: nothing is in flight in it
                    self.duties.allow(t.prompts_per_step)
            if self.step == t.steps:
                self.write_outputs()
        finally:
            self.close()
        return 0

    def warm_start(self) -> None:
        """A fresh run: the supervised warm start, then the KL reference is the policy RL starts from."""
        if self.state.step == 0 and self.cfg.train.sft_warmup_steps:
            _sft_warmup(self.cfg, self.policy, self.hf_path, self.duties)
        if self.state.step == 0:
            self.policy.capture_reference()  # algo.kl_coef > 0 only

    def connect_engines(self) -> None:
        """Engines and rollout process (rank 0), the weight-update channels, the engines brought level with
        the trainer's weights, then generation starts."""
        t = self.cfg.train
        endpoints = broadcast_object(self.duties.start_engines(self.hf_path, self.policy, self.state))
        if self.policy.lora is not None:
            self.syncer = self._adapter_channel(endpoints)
        else:
            self.syncer = EngineSync(*self._channels(endpoints), self.layout, endpoints, rebuild=self._channels,
                                     model=self.policy.module, probe_timeout_s=self.cfg.weight_sync.probe_timeout_s)
        self.syncer.connect()
        if self.state.step > 0 or t.sft_warmup_steps:  # engines start from the HF checkpoint: bring them level
            self.version += 1
            self.syncer.sync(str(self.version))
        self.policy.version.synced(self.version)  # the engines' weights are the trainer's now
        self.verify_engines()
        self.duties.start_producing(t.max_inflight_groups if t.mode == LoopMode.overlap else t.prompts_per_step,
                                    self.state.step)

    def _channels(self, engines: list[EngineEndpoint]):
        """Transport + disk repair for ``engines``; also rebuilt without an engine that died (per-run group
        names: never reused)."""
        ws = self.cfg.weight_sync
        return make_transport(
            ws.transport, model=self.policy.model, layout=self.layout, bridge=self.policy.bridge,
            padded_vocab=self.policy.padded_vocab, engines=engines, bucket_bytes=int(ws.bucket_mb * (1 << 20)),
            export_dir=ws.export_dir or os.path.join(self.cfg.run_dir, "weights"), config_src=self.hf_path,
            timeout_s=ws.timeout_s, group_prefix=broadcast_object(f"mrl-{os.urandom(4).hex()}"),
            dtype=self.cfg.rollout.engine_dtype, master_address=ws.master_address)

    def _adapter_channel(self, engines: list[EngineEndpoint]) -> AdapterChannel:
        """LoRA: versions go to the engines as adapters, over HTTP whatever ``weight_sync.transport`` (``disk``
        has them load each from ``weight_sync.export_dir``); the engines' base weights never change."""
        ws = self.cfg.weight_sync
        export_dir = (ws.export_dir or os.path.join(self.cfg.run_dir, "weights")) \
            if ws.transport == WeightTransport.disk else None
        return AdapterChannel(self.policy, self.layout, engines, spec=lora_engine_spec(self.cfg),
                              timeout_s=ws.timeout_s, probe_timeout_s=ws.probe_timeout_s, export_dir=export_dir,
                              dtype=getattr(torch, self.cfg.rollout.engine_dtype), on_loaded=self.duties.set_adapter)

    def take_batch(self) -> tuple[RLBatch, float, dict]:
        """Rank 0 takes ``train.prompts_per_step`` groups within the staleness bound; every rank gets the samples
        its DP rank trains on (``BatchScatter``)."""
        return self.batches.deliver(self.duties.next_batch(self.version), what=f"the step-{self.step + 1} batch")

    def train_step(self, batch: RLBatch, normalizer: float) -> dict:
        """Routing metrics (on the weights the samples are judged by), then the RL step."""
        t, m = self.cfg.train, {}
        if t.replay and t.routing_metrics_every and self.step % t.routing_metrics_every == 0:
            m |= self.policy.routing_metrics(batch)
        t0 = time.perf_counter()
        m |= self.policy.rl_step(batch, normalizer)
        return m | {"train_seconds": time.perf_counter() - t0}

    def sync_weights(self) -> dict:
        """The next weight version to the engines: restarted engines join, in-flight requests are drained
        around the push when it pauses the engines (they resume on the new weights), dead engines are
        dropped and replaced."""
        self.version += 1
        joining = broadcast_object(self.duties.joining_engines(), what="the engines joining at this sync") \
            if restarts_engines(self.cfg) else []
        pause = self.syncer.pauses_engines  # an adapter push pauses nothing: generation goes on
        t0 = time.perf_counter()
        drained = self.duties.drain() if pause else 0
        m = {"drain_seconds": time.perf_counter() - t0} if pause else {}
        try:
            if joining:  # restarted engines: new groups with them; this sync gives them the weights
                self.syncer.add(joining)
            rep = self.syncer.sync(str(self.version))
            self.policy.version.synced(self.version)
        finally:
            if pause:
                self.duties.undrain()
        m |= self.verify_engines()
        m |= self.duties.after_sync(self.syncer.engines, joining, rep.dropped_engines)
        m["sync_aborted_requests"] = float(drained)
        if rep.bytes_sent and rep.bytes_in_place is not None:  # rank 0's buckets: the share sent from its params
            m["sync_in_place_fraction"] = rep.bytes_in_place / rep.bytes_sent
        return m | {"sync_seconds": rep.seconds, "sync_bytes": float(rep.bytes_sent),
                    "sync_repaired": float(len(rep.repaired_from_disk)),
                    "engines_alive": float(len(self.syncer.engines)),
                    "engines_dropped": float(len(self.syncer.dropped))}

    def verify_engines(self) -> dict:
        """``weight_sync.verify``: every engine's logprobs of a fixed probe equal the trainer's, within
        ``weight_sync.verify_tol``, or the run stops naming them (``verify_engines``)."""
        ws = self.cfg.weight_sync
        if not (ws.verify if ws.verify is not None else self.cfg.rollout.engine_dtype == "float32"):
            return {}
        diffs, unreachable = verify_engines(self.policy.module, self.layout, self.syncer.engines,
                                            vocab_size=self.policy.bridge.vocab_size, tol=ws.verify_tol,
                                            version=str(self.version), seed=self.cfg.seed,
                                            lora_path=self.syncer.adapter, timeout_s=ws.timeout_s)
        return {"sync_verify_max_diff": max(diffs.values(), default=0.0),
                "sync_verify_unreachable": float(len(unreachable))}

    def maybe_checkpoint(self) -> bool:
        """Checkpoint every ``train.save_every`` steps, at the end, and before stopping (SIGUSR1,
        ``train.stop_after``); whether to stop."""
        t = self.cfg.train
        stop = broadcast_object(self.preempted or (t.stop_after is not None and self.step >= t.stop_after))
        if stop or (t.save_every and self.step % t.save_every == 0) or self.step == t.steps:
            path = os.path.join(_checkpoint_dir(self.cfg), f"step_{self.step}")
            check_finite_weights(self.policy.module, f"checkpoint {path}")
            self.policy.save(path)
            dist.barrier()  # every rank's shards written before rank 0 syncs them and marks the checkpoint
            self.duties.save_loop_state(path, LoopState(step=self.step, version=self.version))
            dist.barrier()
        return stop

    def write_outputs(self) -> None:
        """At the end of a run: a LoRA run's final adapter as a Hugging Face PEFT directory, ``run_dir/adapter``
        (the checkpoints hold it in megatron's sharded format, for resuming). Collective."""
        if self.policy.lora is None:
            return
        out = self.policy.export_lora(dst=0)
        if out is not None:
            save_peft(os.path.join(self.cfg.run_dir, "adapter"), *out)
        dist.barrier()

    def close(self) -> None:
        if self.syncer is not None:
            self.syncer.close()
        self.duties.close()

    def _on_usr1(self, *_) -> None:
        self.preempted = True


def main(cfg: Config, engines: list | None = None) -> int:
    code = Loop(cfg, engines).run()
    destroy()
    return code


if __name__ == "__main__":
    sys.exit(main(load_resolved(sys.argv[1])))
