"""The rollout side of the loop in a process of its own: engine clients, producer, scorers, buffer.

    svc = RolloutService.start(cfg, hf_path, urls, codec, state)   # trainer rank 0; the child holds a LocalRollout
    svc.allow(16); groups = svc.take(8, version, timeout=600)
    n = svc.drain(60); ...weight sync...; svc.undrain()
    svc.submit_eval(step, version); svc.eval_results(0.0)   # evaluation in the background, results when done
    svc.stats(); svc.state(); svc.stop()

Both are a ``RolloutSide`` (``mrl.rollout.side``). Why a process: in the trainer's rank-0 process the
producer's event loop (HTTP, JSON, routes decoding, reward calls) and the training step would share one
GIL; here the trainer only exchanges a few pickled messages per step with this process.

The child is ``python -m mrl.rollout.service`` (it never imports torch.distributed or megatron); it
connects back to a loopback listener whose address and key travel in its environment, never on a
command line. It dies with the trainer (``PR_SET_PDEATHSIG``) and exits when the trainer's connection
closes, so a trainer that dies leaves no child.
Calls are served one at a time; errors (a failed producer, a batch timeout) come back as the same
exception types and messages the in-process objects raise.
"""

from __future__ import annotations

import abc
import functools
import inspect
import os
import pickle
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Client, Connection, Listener
from typing import Callable

from mrl.log import get_logger
from mrl.rollout.side import RolloutSide

log = get_logger(__name__)

ADDR_ENV, KEY_ENV = "MRL_ROLLOUT_SERVICE_ADDR", "MRL_ROLLOUT_SERVICE_KEY"
_REPLY_MARGIN_S = 60.0  # a call's own limit (take's timeout, drain's) plus this, before the child counts as hung


class RolloutServiceError(RuntimeError):
    pass


class RolloutService(RolloutSide):
    """Trainer rank 0's proxy of the rollout process. Every ``RolloutSide`` method but ``stop`` sends its
    name and arguments to the child, whose ``LocalRollout`` answers (``_serve``); those methods are
    generated from the interface (below the class). A call may take its ``timeout`` argument, if it has
    one, else ``call_timeout_s`` (``SLOW_CALLS``: that many times), plus a margin, before the child counts
    as hung."""

    SLOW_CALLS: dict[str, int] = {}
    """Calls of many engine round trips: their reply limit in multiples of ``call_timeout_s``."""

    def __init__(self, proc: subprocess.Popen, conn: Connection, call_timeout_s: float):
        self.proc, self.conn, self.call_timeout_s = proc, conn, call_timeout_s
        self._lock = threading.Lock()

    @classmethod
    def start(cls, cfg, hf_path: str, urls: list[str], codec, state, *, connect_timeout_s: float = 120.0,
              call_timeout_s: float = 120.0) -> "RolloutService":
        """Start the child and build its ``LocalRollout(cfg, hf_path, urls, codec, state)``."""
        key = os.urandom(32)
        listener = Listener(("127.0.0.1", 0), authkey=key)
        host, port = listener.address
        env = dict(os.environ, **{ADDR_ENV: f"{host}:{port}", KEY_ENV: key.hex()})
        # the trainer runs as ``python -m mrl.jobs.train`` from the job's directory: reward fns by dotted path
        # (e.g. tests.e2e.reward_fns) resolve against it, so the child gets it on its path too
        env["PYTHONPATH"] = os.pathsep.join(p for p in [os.getcwd(), env.get("PYTHONPATH", "")] if p)
        from mrl.process import child_setup

        # dies with this process (PR_SET_PDEATHSIG), even while it serves a long call (a batch wait)
        proc = subprocess.Popen([sys.executable, "-m", "mrl.rollout.service"], env=env, preexec_fn=child_setup(None))
        conn = _accept(listener, proc, connect_timeout_s)
        svc = cls(proc, conn, call_timeout_s)
        svc._call(INIT, (cfg, hf_path, urls, codec, state), connect_timeout_s)
        return svc

    def _call(self, method: str, args: tuple, timeout: float):
        limit = timeout + _REPLY_MARGIN_S
        with self._lock:
            try:
                self.conn.send((method, args))
                deadline = time.monotonic() + limit
                while not self.conn.poll(0.5):
                    if self.proc.poll() is not None:
                        raise RolloutServiceError(f"the rollout process exited (code {self.proc.returncode}) "
                                                  f"during {method}; its error is printed above")
                    if time.monotonic() > deadline:
                        raise RolloutServiceError(f"the rollout process did not answer {method} within {limit:.0f} s")
                ok, value = self.conn.recv()
            except (EOFError, OSError, BrokenPipeError) as e:
                raise RolloutServiceError(f"lost the rollout process during {method} "
                                          f"(exit code {self.proc.poll()}): {e!r}") from e
        if not ok:
            raise value
        return value

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self._call("stop", (), 60)
            except Exception:  # stopping anyway
                pass
        try:
            self.conn.close()
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _forward(method):
    """``RolloutService``'s version of interface method ``method``: a call to the child."""
    name, sig = method.__name__, inspect.signature(method)

    @functools.wraps(method)
    def call(self: RolloutService, *args, **kwargs):
        bound = sig.bind(self, *args, **kwargs)
        bound.apply_defaults()
        given = dict(bound.arguments)
        del given["self"]
        timeout = given.get("timeout", self.call_timeout_s * self.SLOW_CALLS.get(name, 1))
        return self._call(name, tuple(given.values()), timeout)

    call.__isabstractmethod__ = False  # wraps copied the interface's True
    return call


SERVED = frozenset(RolloutSide.__abstractmethods__)
"""The calls the child answers: every method of the interface (``stop`` included)."""
INIT = "init"
for _name in SERVED - set(vars(RolloutService)):
    setattr(RolloutService, _name, _forward(getattr(RolloutSide, _name)))
abc.update_abstractmethods(RolloutService)


def _accept(listener: Listener, proc: subprocess.Popen, timeout_s: float) -> Connection:
    box: list = []
    t = threading.Thread(target=lambda: box.append(listener.accept()), daemon=True)
    t.start()
    deadline = time.monotonic() + timeout_s
    while not box:
        if proc.poll() is not None:
            raise RolloutServiceError(f"the rollout process exited (code {proc.returncode}) before connecting")
        if time.monotonic() > deadline:
            proc.kill()
            raise RolloutServiceError(f"the rollout process did not connect within {timeout_s:.0f} s")
        t.join(0.1)
    listener.close()
    return box[0]


# -- the child ---------------------------------------------------------------------------------------
class LocalRollout(RolloutSide):
    """The rollout side's objects, held by the rollout process (the producer runs in a thread of its own)."""

    def __init__(self, cfg, hf_path: str, urls: list[str], codec, state):
        from mrl.rollout.buffer import RolloutBuffer
        from mrl.config.schema import LoopMode, StalePolicy
        from mrl.data import build_prompt_source, load_tokenizer
        from mrl.reward.scorer import RewardScorer
        from mrl.sglang.client import EngineClient
        from mrl.config.lora_engine import lora_engine_spec
        from mrl.rollout.lora import AdapterRouter
        from mrl.rollout.manager import RolloutManager
        from mrl.rollout.producer import Producer
        from mrl.rollout.sample import SamplingSpec
        from mrl.routing.sampling_mask import top_logprobs_to_request

        r, t = cfg.rollout, cfg.train
        self.tok = load_tokenizer(hf_path)
        eos = state["eos"]
        sampling = SamplingSpec(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                                top_k=r.top_k, min_p=r.min_p, ignore_eos=r.ignore_eos,
                                stop_token_ids=[eos] if isinstance(eos, int) else list(eos or []))
        clients = [EngineClient(u, routes_always=True) for u in urls]  # eval shares the engines with rollouts
        # LoRA: one router for both managers, so neither unloads an adapter the other's requests hold
        self.adapters = AdapterRouter() if lora_engine_spec(cfg) is not None else None
        top = top_logprobs_to_request(temperature=r.temperature, top_k=r.top_k, top_logprobs_num=r.top_logprobs_num) \
            if t.sampling_mask else 0
        self.manager = RolloutManager(clients, sampling=sampling, codec=codec if t.replay else None,
                                      max_inflight_per_engine=cfg.engine.max_running_requests, top_logprobs_num=top,
                                      adapters=self.adapters, probe_timeout_s=cfg.weight_sync.probe_timeout_s,
                                      vocab_size=state.get("vocab_size"),
                                      inflight_updates=cfg.weight_sync.keeps_requests)
        self.scorer = RewardScorer(cfg.reward)  # reward.fn: evaluation's, and the group scorer's rule part
        sources = functools.partial(build_prompt_source, cfg.data, model_dir=hf_path, max_new_tokens=r.max_new_tokens)
        source = sources()
        self.eval_source = sources(split="eval") if t.eval_every and t.eval_heldout else None
        env_fn = r.env.fn or getattr(source, "env", None)  # a built-in multi-turn task names its environment
        self.episodes = self._episodes = None
        if env_fn is not None:
            from mrl.rollout.multiturn import EpisodeLimits, EpisodeRunner

            limits = EpisodeLimits(max_turns=r.env.max_turns, max_total_tokens=r.env.max_total_tokens,
                                   # unset: what a built-in task's turns need, else max_new_tokens
                                   max_turn_tokens=(r.env.max_turn_tokens or getattr(source, "max_turn_tokens", None)
                                                    or r.max_new_tokens),
                                   tool_timeout_s=r.env.tool_timeout_s)
            self._episodes = lambda m: EpisodeRunner(m, self.tok, env_fn=env_fn, env_args=r.env.args, limits=limits)
            self.episodes = self._episodes(self.manager)
        from mrl.rollout.scorers import build_scorer

        # teacher engines (on-policy distillation) start booting here, while the first groups generate
        self.group_scorer = build_scorer(cfg, self.scorer, episodes=self.episodes is not None, student_path=hf_path,
                                         side_engines=state.get("side_engines"))
        self.evaluator = self._evaluator(cfg, clients, sampling) if t.eval_every else None
        self._cache_seen = (0, 0)  # (prompt, cached) tokens at the last stats(): the hit rate is per step
        self.buffer = RolloutBuffer(max_staleness=t.max_staleness, drop_stale=t.stale_policy == StalePolicy.drop)
        if state["buffered"]:
            self.buffer.restore(state["buffered"])
        self.producer = Producer(manager=self.manager, scorer=self.group_scorer, source=source,
                                 tokenizer=self.tok, buffer=self.buffer, group_size=r.n_samples_per_prompt,
                                 dynamic_sampling=cfg.algo.dynamic_sampling, start_index=state["prompt_index"],
                                 redo=state.get("redo_prompts"), episodes=self.episodes)
        if t.mode == LoopMode.overlap:
            self.buffer.on_release = self.producer.allow
        for src in (source, self.eval_source):  # a dataset from files: what was read, kept and left out
            if hasattr(src, "counts"):
                log.info("data: %s", src.summary())
                self.producer.counts.update(src.counts())

    def _evaluator(self, cfg, clients, sampling):
        """The evaluation sets' prompts and completers: one temperature-0 manager for the greedy completions,
        one per set for its sampled ones, each at most ``train.eval_max_inflight`` requests per engine (the
        evaluator's own cap holds them to that many in all)."""
        from dataclasses import replace

        from mrl.config.eval import HELDOUT
        from mrl.data import JsonlDataset
        from mrl.rollout.evaluation import Completer, EvalSet, Evaluator
        from mrl.rollout.manager import RolloutManager

        t, d = cfg.train, cfg.data

        def completer(spec):
            m = RolloutManager(clients, sampling=spec, adapters=self.adapters,
                               max_inflight_per_engine=t.eval_max_inflight,
                               probe_timeout_s=cfg.weight_sync.probe_timeout_s,
                               inflight_updates=cfg.weight_sync.keeps_requests)
            return Completer(m, self._episodes(m) if self._episodes else None)

        greedy = None
        sets = []
        for sc in t.eval_sets:
            src = self.eval_source if sc.source == HELDOUT else JsonlDataset(
                sc.source, prompt_key=d.prompt_key, answer_key=d.answer_key, id_key=d.id_key,
                on_bad_row=d.on_bad_row, seed=d.seed, shuffle=False)
            if sc.greedy and greedy is None:
                greedy = completer(replace(sampling, temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0,
                                           ignore_eos=False))
            sampled = completer(replace(sampling, temperature=sc.temperature, top_p=sc.top_p, top_k=-1, min_p=0.0,
                                        ignore_eos=False)) if sc.n else None
            if not len(src):
                raise ValueError(f"train.eval_sets[{sc.name}]: its source {sc.source!r} holds no prompt")
            sets.append(EvalSet(cfg=sc, prompts=[src.sample(i) for i in range(min(sc.max_prompts, len(src)))],
                                greedy=greedy if sc.greedy else None, sampled=sampled,
                                default_budget=sampling.max_new_tokens))
        return Evaluator(sets, self.scorer, self.tok, max_inflight=t.eval_max_inflight)

    def start_producing(self, credits: int) -> None:
        self.producer.start()
        self.producer.allow(credits)

    def allow(self, n: int) -> None:
        self.producer.allow(n)

    def take(self, n: int, version: int, timeout: float):
        self.producer.check()
        return self.buffer.take(n, version, timeout=timeout, check=self.producer.check)

    def drain(self, timeout: float) -> int:
        return self.producer.drain(timeout, also=self._eval_managers())

    def undrain(self) -> None:
        self.producer.undrain(also=self._eval_managers())

    def _eval_managers(self) -> list:
        return self.evaluator.managers if self.evaluator is not None else []

    def submit_eval(self, step: int, version: int) -> bool:
        if self.evaluator is None:
            raise RuntimeError("submit_eval: train.eval_every=0, the rollout side was built without evaluation sets")

        async def request():  # on the producer's loop, which owns the managers
            return self.evaluator.request(step, version)

        return self.producer.run(request())

    def eval_results(self, timeout: float) -> list:
        if self.evaluator is None:
            return []
        return self.producer.run(self.evaluator.collect(timeout))

    def count(self, key: str, n: int = 1) -> None:
        self.producer.counts[key] += n

    def add_engine(self, url: str) -> None:
        from mrl.sglang.client import EngineClient

        client = EngineClient(url, routes_always=True)

        async def add():  # on the producer's loop, which owns the slots
            for m in [self.manager, *self._eval_managers()]:
                m.add_engine(client)

        self.producer.run(add())

    def set_adapter(self, name: str, version: int) -> None:
        if not self.producer.running:  # before the first rollout: unloads wait for the loop
            self.manager.set_adapter(name, version)
            return

        async def switch():  # on the producer's loop, which owns the router and the clients
            self.manager.set_adapter(name, version)

        self.producer.run(switch())

    def stats(self) -> dict:
        """Counters since the start; ``counts["prefix_cache_hit_rate"]`` is since the previous call (the
        loop calls once per step): input tokens of the engine calls that the radix cache already held."""
        bs, ms = self.buffer.stats, self.manager.stats
        counts = dict(self.producer.counts)
        if self.episodes is not None:
            counts |= {f"env_{k}": v for k, v in self.episodes.stats().items()}
        counts |= {f"scoring_{k}": v for k, v in self.group_scorer.stats().items()}
        prompt, cached = ms.prompt_tokens - self._cache_seen[0], ms.cached_tokens - self._cache_seen[1]
        self._cache_seen = (ms.prompt_tokens, ms.cached_tokens)
        if prompt > 0:
            counts["prefix_cache_hit_rate"] = cached / prompt
        if self.adapters is not None:
            counts["lora_adapters_live"] = len(self.adapters.live())
            counts["lora_unload_errors"] = len(self.adapters.errors)
        return {"dropped_stale": bs.dropped_stale, "buffered": len(self.buffer), "staleness": dict(bs.staleness),
                "counts": counts, "samples_failed": ms.failed, "samples_submitted": ms.submitted,
                "samples_completed": ms.completed, "engine_failures": ms.engine_failures, "retries": ms.retries,
                "served_by_engine": {s.client.url: s.served for s in self.manager.slots}}

    def state(self):
        """(next prompt index, buffered groups, prompts to redo): unfinished groups read before the buffer,
        so a group buffered in between is kept once (buffered), never twice."""
        unfinished = self.producer.unfinished()
        buffered = self.buffer.state()
        done = {g.samples[0].group_id for g in buffered if g.samples}
        return self.producer.next_index, buffered, [i for i in unfinished if i not in done]

    def stop(self) -> None:
        from mrl.sglang.client import close_clients

        if self.producer.running:  # its loop owns the clients' connections
            if self.evaluator is not None:
                async def cancel():
                    self.evaluator.cancel()

                self.producer.run(cancel())
            self.producer.run(close_clients([s.client for s in self.manager.slots]))
            self.producer.run(self.group_scorer.aclose())
        self.producer.stop()
        self.group_scorer.close()  # teacher engines included
        self.scorer.close()


def _serve(conn: Connection, make: Callable[..., RolloutSide] = LocalRollout) -> None:
    """Answer the trainer's calls, one at a time, until ``stop`` or its connection closes: ``init`` builds
    the rollout side (``make(*args)``), any other call is a ``RolloutSide`` method of it."""
    rollout: RolloutSide | None = None
    method = None
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):  # the trainer is gone: so is the run
            break
        try:
            if method == INIT:
                rollout = make(*args)
                value = None
            elif method in SERVED:
                value = getattr(rollout, method)(*args)
            else:
                raise RolloutServiceError(f"the rollout process serves no call {method!r}")
            reply = (True, value)
        except BaseException as e:  # sent back, raised again in the trainer
            reply = (False, _picklable(e))
        conn.send(reply)
        if method == "stop":
            break
    if rollout is not None and method != "stop":
        try:
            rollout.stop()
        except Exception:
            pass


def _picklable(e: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RolloutServiceError(f"{type(e).__name__}: {e}")


def main() -> int:
    import signal

    # Slurm's preemption SIGUSR1 and a terminal's Ctrl-C are the trainer's to handle (it checkpoints, then
    # stops us); we end when its connection closes
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    host, port = os.environ.pop(ADDR_ENV).rsplit(":", 1)
    key = bytes.fromhex(os.environ.pop(KEY_ENV))
    conn = Client((host, int(port)), authkey=key)
    _serve(conn)
    return 0


if __name__ == "__main__":
    sys.exit(main())
