"""A pool of scoring engines (SGLang servers): started by the run or attached by URL, health-checked, the
dead ones replaced, every call failed over to a live one.

    pool = ScoringPool(cfg.scoring.teacher, model_path, log_dir="runs/x/engines", name="teacher").start()
    logps = await pool.input_logprobs(token_ids, start=len(prompt_ids), rid="g3-s1")  # prefill only
    pool.stats(); pool.close()

Engines the run starts are the launcher's (``mrl.engine.launcher``: the run's keys, the same flags and
health check as rollout engines), booting in the background: calls wait for the first healthy one. A call
that fails on an engine (refused, reset, a 5xx, its limit passed) probes it (``mrl.sglang.client.liveness``);
a dead or hung engine is taken out of rotation, killed and replaced (``mrl.engine.restart``, up to
``max_restarts`` in all), and the call goes to another engine, or waits for the replacement. Engines
given by URL are never restarted. With no engine left and none booting, ``NoScoringEngine`` stops the run;
a call that failed ``max_retries + 1`` times raises ``ScoringError`` (its group is dropped).
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from dataclasses import dataclass

from mrl.config.scoring import TeacherConfig
from mrl.engine.launcher import Engine, engines_from_config
from mrl.engine.restart import EngineRestarter
from mrl.scoring.base import NoScoringEngine, ScoringError
from mrl.sglang.client import ClientTimeouts, EngineClient, close_clients, liveness
from mrl.sglang.protocol import EngineHTTPError, EngineProtocolError, EngineUnavailable

PROBE_TIMEOUT_S = 15.0


@dataclass
class _Slot:
    client: EngineClient
    engine: Engine | None  # None: attached by URL
    inflight: int = 0
    healthy: bool = True
    served: int = 0


class ScoringPool:
    def __init__(self, cfg: TeacherConfig, model_path: str, *, log_dir: str, name: str = "teacher"):
        self.cfg, self.model_path, self.name = cfg, model_path, name
        eng = cfg.engine
        self.timeouts = ClientTimeouts(generate=cfg.timeout_s)
        self.slots: list[_Slot] = [_Slot(EngineClient(u, timeouts=self.timeouts), None) for u in eng.urls]
        self.engines: list[Engine] = [] if eng.urls else engines_from_config(
            eng, model_path, log_dir=log_dir, names=[f"{name}{i}" for i in range(eng.count)])
        for e in self.engines:
            e.return_routed_experts = False  # nothing here replays routes
        self.restarter = EngineRestarter(self.engines, eng.max_restarts, cfg.health_timeout_s)
        self._booting: set[Engine] = set()
        self._ready: list[Engine] = []
        self._replacements_joined = 0
        self._replacing = 0  # replacements being started (the dead engine is killed first: seconds)
        self._lock = threading.Lock()
        self.counts: Counter = Counter()
        self.errors: list[str] = []  # replacements or starts that failed

    def start(self) -> "ScoringPool":
        """Start the run's engines (they boot in the background); attached ones are used as they are."""
        for e in list(self.engines):
            e.start()
            self._boot(e)
        return self

    def _boot(self, e: Engine) -> None:
        with self._lock:
            self._booting.add(e)
        threading.Thread(target=self._wait_healthy, args=(e,), name=f"{e.name}-health", daemon=True).start()

    def _wait_healthy(self, e: Engine) -> None:
        try:
            e.wait_healthy(self.cfg.health_timeout_s)
        except Exception as err:  # counted; the pool goes on with the others
            with self._lock:
                self.errors.append(f"{e.name}: {err}".splitlines()[0])
                self._booting.discard(e)
            return
        with self._lock:
            self._booting.discard(e)
            self._ready.append(e)

    def _join_ready(self) -> None:
        with self._lock:
            ready, self._ready = self._ready, []
        replacements = self.restarter.take_ready()
        self._replacements_joined += len(replacements)
        for e in ready + replacements:
            self.slots.append(_Slot(EngineClient(e.url, timeouts=self.timeouts), e))

    async def _pick(self) -> _Slot:
        """The healthy engine with the fewest calls in flight; waits while none is healthy and one boots."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.health_timeout_s
        while True:
            self._join_ready()
            healthy = [s for s in self.slots if s.healthy]
            if healthy:
                return min(healthy, key=lambda s: s.inflight)
            with self._lock:
                booting = bool(self._booting) or self._replacing > 0 or (
                    self.restarter.restarted > len(self.restarter.failed) + self._replacements_joined)
            if not booting or loop.time() > deadline:
                raise NoScoringEngine(f"{self.name}: no engine left to score on (down: "
                                   f"{[s.client.url for s in self.slots]}; failed starts: {self.errors})")
            await asyncio.sleep(0.25)

    async def input_logprobs(self, ids: list[int], *, start: int, rid: str) -> list[float]:
        """Log-probabilities of ``ids[start:]``, each given the tokens before it, by prefill alone
        (``max_new_tokens=0``); ``start`` >= 1. Fails over to another engine up to ``max_retries`` times."""
        if not 1 <= start < len(ids):
            raise ValueError(f"input_logprobs: start={start} must be in [1, {len(ids)})")
        last: Exception | None = None
        for attempt in range(self.cfg.max_retries + 1):
            slot = await self._pick()
            slot.inflight += 1
            try:
                out = await slot.client.generate(ids, {"max_new_tokens": 0}, rid=f"{rid}-a{attempt}",
                                                 return_logprob=True, logprob_start_len=start - 1)
                got = out.input_logprobs or []
                if len(got) < len(ids) - start or any(x is None for x in got[len(got) - (len(ids) - start):]):
                    raise EngineProtocolError(slot.client.url, "/generate", f"{len(got)} input logprobs for "
                                              f"{len(ids) - start} scored tokens")
                slot.served += 1
                return [float(x) for x in got[len(got) - (len(ids) - start):]]
            except (EngineUnavailable, EngineProtocolError) as e:
                last = e
                self.counts["call_failures"] += 1
                await self._failed(slot, e)
            except EngineHTTPError:
                raise  # the request itself is refused: another engine would refuse it too
            finally:
                slot.inflight -= 1
        raise ScoringError(f"{self.name}: gave up after {self.cfg.max_retries} retries: {last}")

    async def _failed(self, slot: _Slot, err: Exception) -> None:
        """After a failed call: an engine that fails its liveness probe is taken out and replaced."""
        if not slot.healthy:
            return
        why = await liveness(slot.client, PROBE_TIMEOUT_S)
        if why is None and not isinstance(err, EngineProtocolError):
            self.counts["timeouts_alive"] += 1  # up, only slow or overloaded: the call is retried
            return
        if not slot.healthy:  # another call judged it meanwhile
            return
        slot.healthy = False
        self.counts["engines_lost"] += 1
        if slot.engine is not None:  # ours: killed (a hung one holds its cores) and replaced, off the loop
            self._replacing += 1
            try:
                started = await asyncio.to_thread(self.restarter.replace, [slot.engine.url])
            finally:
                self._replacing -= 1
            self.counts["engines_restarted"] += len(started)

    def stats(self) -> dict[str, float]:
        out = {k: float(v) for k, v in self.counts.items()}
        out["engines_healthy"] = float(sum(s.healthy for s in self.slots))
        out["engines_start_failed"] = float(len(self.errors) + len(self.restarter.failed))
        return out

    async def aclose(self) -> None:
        await close_clients([s.client for s in self.slots])

    def close(self) -> None:
        for e in self.engines:  # replacements included: the restarter appends them to this list
            e.stop()
