"""Rank 0's part of the loop (``Controller``: engines, rollout process, metrics, the loop state) and the
other ranks' (``OtherRank``: nothing), behind one interface, ``RankDuties``."""

from __future__ import annotations

import abc
import os
import time
from collections import Counter

from mrl.config.schema import BadRoutes, Config, LoopMode
from mrl.sglang.endpoint import EngineEndpoint
from mrl.engine.restart import EngineRestarter, kill_engines
from mrl.log import get_logger
from mrl.megatron.policy import Policy, RLBatch
from mrl.metrics import MetricsLog
from mrl.rollout.buffer import Group
from mrl.rollout.service import RolloutService
from mrl.rollout.side import RolloutSide
from mrl.routing.replay import check_routes
from mrl.trainer.batch import build_batch
from mrl.trainer.engines import RunEngines
from mrl.trainer.state import LoopState, checkpoint_dir, prune_checkpoints, tree_bytes, write_loop_state
from mrl.startup import StartupClock

log = get_logger(__name__)


class EvalBook:
    """The controller's record of evaluations submitted, not yet reported, and skipped."""

    def __init__(self):
        self.waiting: Counter = Counter()  # step -> set results still to arrive
        self.skipped: tuple[int, int] | None = None  # the newest skipped (step, version)
        self.skips = 0

    @property
    def outstanding(self) -> int:
        return sum(self.waiting.values())

    def submitted(self, step: int, sets: int) -> None:
        self.waiting[step] += sets
        if self.skipped is not None and self.skipped[0] <= step:
            self.skipped = None

    def arrived(self, step: int) -> None:
        self.waiting[step] -= 1
        if self.waiting[step] <= 0:
            del self.waiting[step]


class RankDuties(abc.ABC):
    """What the loop asks of rank 0 beyond the collective steps every rank runs. ``Controller`` does it on
    rank 0; ``OtherRank`` answers the same calls on the other ranks with nothing, so that the loop never
    branches on the rank. Every method is abstract: a side that misses one cannot be built."""

    @abc.abstractmethod
    def start_engines(self, hf_path: str, policy: Policy, state: LoopState) -> list[EngineEndpoint] | None:
        """Start or find the engines, then the rollout process; the endpoints the weight sync serves."""

    @abc.abstractmethod
    def next_batch(self, version: int) -> tuple[RLBatch, float, dict] | None:
        """The step's batch with its advantages, loss normalizer and reward figures."""

    @abc.abstractmethod
    def joining_engines(self) -> list[EngineEndpoint] | None:
        """Restarted engines that are healthy now: they join at this sync."""

    @abc.abstractmethod
    def drain(self) -> int:
        """Abort the engines' in-flight requests and hold new ones (resumed after the sync); how many."""

    @abc.abstractmethod
    def undrain(self) -> None:
        """Generation goes on after a sync."""

    @abc.abstractmethod
    def set_adapter(self, name: str, version: int) -> None:
        """LoRA: new requests name adapter ``name``, loaded on every engine (their tokens get ``version``)."""

    @abc.abstractmethod
    def after_sync(self, alive: list[EngineEndpoint], joining: list[EngineEndpoint], dropped: list[str]) -> dict:
        """Joined engines take rollouts now (they hold this version); dropped ones get replacements."""

    @abc.abstractmethod
    def start_producing(self, first_credits: int, step: int, version: int) -> None:
        """Generation starts, ``first_credits`` groups ahead (and the first evaluation, of weights ``version``)."""

    @abc.abstractmethod
    def warm_start_progress(self, step: int, nll: float) -> None:
        """One step of the supervised warm start is done."""

    @abc.abstractmethod
    def log_step(self, step: int, m: dict, wall_seconds: float) -> None:
        """The step's metrics."""

    @abc.abstractmethod
    def maybe_evaluate(self, step: int, version: int) -> None:
        """Every ``train.eval_every`` steps, submit an evaluation of weights ``version``; report the results
        that have arrived. Never waits for generation."""

    @abc.abstractmethod
    def finish_evaluations(self, wait_s: float) -> bool | None:
        """The run's end: wait up to ``wait_s`` more (``train.eval_wait_at_end_s`` in all) for the evaluations
        still generating, and submit the last step's if it was skipped; whether nothing is left to wait for."""

    @abc.abstractmethod
    def checkpoint_written(self, path: str, seconds: float, asynchronous: bool) -> None:
        """Checkpoint ``path`` is complete, ``seconds`` after its save began: say so, with its size."""

    @abc.abstractmethod
    def allow(self, n: int) -> None:
        """Sync mode: let the producer generate the next batch."""

    @abc.abstractmethod
    def save_loop_state(self, path: str, state: LoopState) -> None:
        """Complete checkpoint ``path`` (every rank's shards are written) with the loop state."""

    @abc.abstractmethod
    def close(self) -> None:
        """End what this side started."""


class Controller(RankDuties):
    """Rank 0's duties: the metrics log, the engines (started here, or attached by URL) and the rollout
    process that feeds the buffer from them (``mrl.rollout.service``: producer, rewards, buffer,
    evaluation)."""

    def __init__(self, cfg: Config, state: LoopState, engines: RunEngines | None = None,
                 clock: StartupClock | None = None):
        """``engines``: the job's (``mrl.jobs.train`` starts them early); None: started at ``start_engines``."""
        self.cfg = cfg
        self.clock = clock or StartupClock()
        self.log = MetricsLog(cfg.run_dir, total=cfg.train.steps, history=state.history, cfg=cfg)
        self.engines = engines or RunEngines(cfg)
        self.restarter: EngineRestarter | None = None
        self.rollout: RolloutSide | None = None
        self.evals = EvalBook()
        self._end_of_evals: float | None = None

    def start_engines(self, hf_path: str, policy: Policy, state: LoopState) -> list[EngineEndpoint]:
        endpoints = self.engines.ready()
        self.clock.mark("engines_healthy")
        self.restarter = EngineRestarter(self.engines.started, self.cfg.engine.max_restarts) \
            if restarts_engines(self.cfg) else None
        self.codec = policy.codec
        self.rollout = RolloutService.start(self.cfg, hf_path, [e.url for e in endpoints], policy.codec, {
            "eos": policy.bridge.hf_config.eos_token_id, "vocab_size": policy.bridge.vocab_size,
            "buffered": state.buffered,
            "prompt_index": state.prompt_index, "redo_prompts": state.redo_prompts or [],
            "side_engines": self.engines.side_groups()})
        self.clock.mark("rollout_started")
        return endpoints

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
        return build_batch(self.take_batch(version), self.cfg, self.cfg.train.replay)

    def start_producing(self, first_credits: int, step: int, version: int) -> None:
        self.rollout.start_producing(first_credits)
        if self.cfg.train.eval_every:
            self._submit_eval(step, version)

    def maybe_evaluate(self, step: int, version: int) -> None:
        t = self.cfg.train
        if t.eval_every and step % t.eval_every == 0:
            self._submit_eval(step, version)
        if self.evals.outstanding:
            self._report_evals(self.rollout.eval_results(0.0), step)

    def _submit_eval(self, step: int, version: int) -> None:
        if self.rollout.submit_eval(step, version):
            self.evals.submitted(step, len(self.cfg.train.eval_sets))
        else:  # the previous one is still generating: this one is skipped, the engines keep their share
            self.evals.skipped = (step, version)
            self.evals.skips += 1
            log.info("evaluation at step %d skipped: the previous one is still generating (%d skipped so far; "
                     "fewer prompts, a larger train.eval_every or train.eval_max_inflight keep up)", step,
                     self.evals.skips)

    def _report_evals(self, results: list, step_now: int | None = None) -> None:
        first = self.cfg.train.eval_sets[0].name
        for r in results:
            self.evals.arrived(r.step)
            row = r.row()
            if r.name == first and "greedy_pass_at_1" in r.metrics:  # the figure the summary and bench tools read
                row["eval/accuracy"] = r.metrics["greedy_pass_at_1"]
            self.log.evaluation(r, row, step_now)

    def finish_evaluations(self, wait_s: float) -> bool:
        t = self.cfg.train
        if not t.eval_every:
            return True
        now = time.monotonic()
        if self._end_of_evals is None:
            self._end_of_evals = now + t.eval_wait_at_end_s
            if self.evals.outstanding or self.evals.skipped:
                log.info("waiting up to %.0f s for the evaluations still generating (train.eval_wait_at_end_s)",
                         t.eval_wait_at_end_s)
        left = self._end_of_evals - now
        if self.evals.outstanding and left > 0:
            self._report_evals(self.rollout.eval_results(min(wait_s, left)))
        if not self.evals.outstanding and self.evals.skipped is not None and self.evals.skipped[0] == t.steps:
            self._submit_eval(*self.evals.skipped)  # the last step's, skipped while the one before it ran
        if self.evals.outstanding and time.monotonic() < self._end_of_evals:
            return False
        if self.evals.outstanding:
            log.warning("%d evaluation results (steps %s) not in after train.eval_wait_at_end_s=%.0f s: not reported",
                        self.evals.outstanding, sorted(self.evals.waiting), t.eval_wait_at_end_s)
        return True

    def warm_start_progress(self, step: int, nll: float) -> None:
        self.log.scalar("sft/nll", nll, step)
        total = self.cfg.train.sft_warmup_steps
        self.log.progress(f"warm start {step + 1}/{total}  nll {nll:.3f}", step + 1, total)

    def joining_engines(self) -> list[EngineEndpoint]:
        return [e.endpoint for e in self.restarter.take_ready()]

    def drain(self) -> int:
        return self.rollout.drain(self.cfg.weight_sync.timeout_s)

    def set_adapter(self, name: str, version: int) -> None:
        self.rollout.set_adapter(name, version)

    def undrain(self) -> None:
        self.rollout.undrain()

    def after_sync(self, alive: list[EngineEndpoint], joining: list[EngineEndpoint], dropped: list[str]) -> dict:
        if self.restarter is None:
            kill_engines(self.engines.started, dropped)  # a hung one would hold its cores to the end of the run
            return {}
        urls = {e.url for e in alive}
        for ep in joining:
            if ep.url in urls:
                self.rollout.add_engine(ep.url)
        self.restarter.replace(dropped)
        return {"engines_restarted": float(self.restarter.restarted),
                "engines_restart_failed": float(len(self.restarter.failed))}

    def log_step(self, step: int, m: dict, wall_seconds: float) -> None:
        """The step's metrics with the rollout side's counters."""
        st = self.rollout.stats()
        m = m | {"dropped_stale": st["dropped_stale"], "buffered": st["buffered"],
                 **{f"rollout/{k}": v for k, v in st["counts"].items()},
                 **{f"rollout/{k}": st[k] for k in ("samples_failed", "samples_submitted", "samples_completed",
                                                    "engine_failures", "retries")}}
        self.log.step(step, m, staleness=Counter({int(k): v for k, v in st["staleness"].items()}),
                      extra={"rollout/served_by_engine": st["served_by_engine"], "wall_seconds": wall_seconds})

    def checkpoint_written(self, path: str, seconds: float, asynchronous: bool) -> None:
        size, name = tree_bytes(path) / 2**30, os.path.basename(path)
        if asynchronous:
            log.info("checkpoint %s complete: %.3g GiB, %.3g s after the save began", name, size, seconds)
        else:
            log.info("checkpoint %s saved: %.3g GiB in %.3g s", name, size, seconds)

    def allow(self, n: int) -> None:
        self.rollout.allow(n)

    def save_loop_state(self, path: str, state: LoopState) -> None:
        state.prompt_index, state.buffered, state.redo_prompts = self.rollout.state()
        state.history = self.log.history
        write_loop_state(path, state)
        prune_checkpoints(checkpoint_dir(self.cfg), self.cfg.train.keep_checkpoints)

    def close(self) -> None:
        if self.rollout is not None:
            self.rollout.stop()
        self.engines.stop()  # replacements included: the restarter appends them to its list
        self.log.close(self.cfg)


class OtherRank(RankDuties):
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

    def start_producing(self, first_credits: int, step: int, version: int) -> None:
        pass

    def warm_start_progress(self, step: int, nll: float) -> None:
        pass

    def undrain(self) -> None:
        pass

    def log_step(self, step: int, m: dict, wall_seconds: float) -> None:
        pass

    def maybe_evaluate(self, step: int, version: int) -> None:
        pass

    def finish_evaluations(self, wait_s: float) -> None:
        return None

    def checkpoint_written(self, path: str, seconds: float, asynchronous: bool) -> None:
        pass

    def allow(self, n: int) -> None:
        pass

    def save_loop_state(self, path: str, state: LoopState) -> None:
        pass

    def close(self) -> None:
        pass


def restarts_engines(cfg: Config) -> bool:
    """Dead engines are replaced: the job started them (not attached by URL) and may restart some."""
    eng = cfg.engine
    return eng.max_restarts > 0 and not (eng.urls or eng.url_dir)
