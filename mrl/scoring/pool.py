"""A pool of scoring engines (SGLang servers): started by the run or attached by URL, health-checked, the
dead ones replaced, every call failed over to a live one.

    pool = ScoringPool(cfg.scoring.teacher, engines=group, name="teacher").start()   # group: None = by URL
    logps = await pool.input_logprobs(token_ids, start=len(prompt_ids), rid="g3-s1")  # prefill only
    verdicts = await pool.candidate_logprobs(token_ids, start=k, candidates=[plus, minus], rid="g3-s1")  # a PRM's
    out = await pool.generate(judge_ids, {"max_new_tokens": 16}, rid="j3-s1")          # a judge's verdict
    score = await pool.classify(ids, rid="rm3-s1")                                     # a reward model's scores
    pool.stats(); pool.close()

The servers the run starts come as an ``EngineSet`` (``mrl.engine.group.EngineGroup``, built on the trainer
side with the run's keys and the same flags and health check as rollout engines), booting in the background:
calls wait for the first healthy one. A call that fails on an engine (refused, reset, a 5xx, its limit
passed) probes it (``mrl.sglang.client.liveness``); a dead or hung engine is taken out of rotation, killed
and replaced by the set (up to its ``max_restarts`` in all), and the call goes to another engine, or waits
for the replacement. Engines given by URL, or on Slurm nodes of the pool's own
(``mrl.cluster.engines.AnnouncedEngines``), are never restarted. With no engine left and none booting,
``NoScoringEngine`` stops the run; a call that failed ``max_retries + 1`` times raises ``ScoringError`` (its
group is dropped).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Protocol, TypeVar

from mrl.config.scoring import EnginePoolConfig
from mrl.scoring.base import NoScoringEngine, ScoringError
from mrl.sglang.client import ClientTimeouts, EngineClient, close_clients, liveness
from mrl.sglang.protocol import EngineProtocolError, EngineUnavailable, GenerateOutput

T = TypeVar("T")


class EngineSet(Protocol):
    """Servers a pool owns: started, their newly healthy URLs taken, a dead one replaced, all stopped."""

    def start(self) -> "EngineSet": ...
    def take_ready(self) -> list[str]: ...
    @property
    def booting(self) -> bool: ...
    def replace(self, url: str) -> int: ...
    @property
    def failed_starts(self) -> int: ...
    def describe_failures(self) -> list[str]: ...
    def close(self) -> None: ...


PROBE_TIMEOUT_S = 15.0


@dataclass
class _Slot:
    client: EngineClient
    ours: bool  # False: attached by URL, never restarted
    inflight: int = 0
    healthy: bool = True
    served: int = 0


class ScoringPool:
    def __init__(self, cfg: EnginePoolConfig, engines: EngineSet | None = None, *,
                 name: str = "teacher"):
        self.cfg, self.engines, self.name = cfg, engines, name
        if (engines is None) == (not cfg.engine.urls):
            raise ValueError(f"{name}: a pool takes engine.urls or the servers the run starts, not both or neither")
        self.timeouts = ClientTimeouts(generate=cfg.timeout_s)
        self.slots: list[_Slot] = [_Slot(EngineClient(u, timeouts=self.timeouts), False) for u in cfg.engine.urls]
        self.counts: Counter = Counter()

    def start(self) -> "ScoringPool":
        """Start the run's engines (they boot in the background); attached ones are used as they are."""
        if self.engines is not None:
            self.engines.start()
        return self

    def _join_ready(self) -> None:
        if self.engines is not None:
            self.slots += [_Slot(EngineClient(u, timeouts=self.timeouts), True) for u in self.engines.take_ready()]

    async def _pick(self) -> _Slot:
        """The healthy engine with the fewest calls in flight; waits while none is healthy and one boots."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.health_timeout_s
        while True:
            self._join_ready()
            healthy = [s for s in self.slots if s.healthy]
            if healthy:
                return min(healthy, key=lambda s: s.inflight)
            booting = self.engines is not None and self.engines.booting
            if not booting or loop.time() > deadline:
                failed = self.engines.describe_failures() if self.engines is not None else []
                raise NoScoringEngine(f"{self.name}: no engine left to score on (down: "
                                      f"{[s.client.url for s in self.slots]}; failed starts: {failed})")
            await asyncio.sleep(0.25)

    async def input_logprobs(self, ids: list[int], *, start: int, rid: str) -> list[float]:
        """Log-probabilities of ``ids[start:]``, each given the tokens before it, by prefill alone
        (``max_new_tokens=0``); ``start`` >= 1. Fails over to another engine up to ``max_retries`` times."""
        if not 1 <= start < len(ids):
            raise ValueError(f"input_logprobs: start={start} must be in [1, {len(ids)})")
        n = len(ids) - start

        async def call(c: EngineClient, r: str) -> list[float]:
            out = await c.generate(ids, {"max_new_tokens": 0}, rid=r, return_logprob=True,
                                   logprob_start_len=start - 1)
            got = (out.input_logprobs or [])[-n:]
            if len(got) < n or any(x is None for x in got):
                raise EngineProtocolError(c.url, "/generate", f"{len(got)} input logprobs for {n} scored tokens")
            return [float(x) for x in got]

        return await self._failover(call, rid=rid)

    async def candidate_logprobs(self, ids: list[int], *, start: int, candidates: list[int],
                                 rid: str) -> list[dict[int, float]]:
        """The log-probabilities of the ``candidates`` ids at each position ``p`` in ``[start, len(ids)]``, given
        ``ids[:p]`` (``p = len(ids)``: the token after the input); ``start`` >= 1. One prefill and one generated
        token; fails over to another engine up to ``max_retries`` times."""
        if not 1 <= start <= len(ids):
            raise ValueError(f"candidate_logprobs: start={start} must be in [1, {len(ids)}]")
        n_in = len(ids) - start  # input positions start .. len(ids) - 1; the last one is the output's

        async def call(c: EngineClient, r: str) -> list[dict[int, float]]:
            out = await c.generate(ids, {"max_new_tokens": 1, "temperature": 0.0}, rid=r, return_logprob=True,
                                   logprob_start_len=start - 1, token_ids_logprob=list(candidates))
            got = (out.input_token_ids_logprobs or [])[-n_in:] if n_in else []
            got += (out.output_token_ids_logprobs or [])[:1]
            if len(got) != n_in + 1 or any(g is None or set(g) != set(candidates) for g in got):
                raise EngineProtocolError(c.url, "/generate", f"candidate logprobs of {len(got)} positions for "
                                          f"{n_in + 1} asked")
            return got

        return await self._failover(call, rid=rid)

    async def generate(self, ids: list[int], sampling_params: dict[str, Any], *, rid: str) -> GenerateOutput:
        """One generation (a judge's verdict) from ``ids``; fails over as ``input_logprobs``."""
        return await self._failover(
            lambda c, r: c.generate(ids, sampling_params, rid=r, return_logprob=False), rid=rid)

    async def classify(self, ids: list[int], *, rid: str) -> list[float]:
        """A classification or reward model's scores of ``ids`` (SGLang ``/classify``); fails over as
        ``input_logprobs``."""
        return await self._failover(lambda c, r: c.classify(ids, rid=r), rid=rid)

    async def _failover(self, call: Callable[[EngineClient, str], Awaitable[T]], *, rid: str) -> T:
        """``call(client, rid)`` on the least busy healthy engine; a failed engine is probed (and replaced when
        dead) and the call moves on, ``max_retries`` times at most. A refusal of the request itself (4xx)
        is raised at once: another engine would refuse it too."""
        last: Exception | None = None
        for attempt in range(self.cfg.max_retries + 1):
            slot = await self._pick()
            slot.inflight += 1
            try:
                out = await call(slot.client, f"{rid}-a{attempt}")
                slot.served += 1
                return out
            except (EngineUnavailable, EngineProtocolError) as e:
                last = e
                self.counts["call_failures"] += 1
                await self._failed(slot, e)
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
        if slot.ours:  # killed (a hung one holds its cores) and replaced, off the event loop
            self.counts["engines_restarted"] += await asyncio.to_thread(self.engines.replace, slot.client.url)

    def stats(self) -> dict[str, float]:
        out = {k: float(v) for k, v in self.counts.items()}
        out["engines_healthy"] = float(sum(s.healthy for s in self.slots))
        out["engines_start_failed"] = float(self.engines.failed_starts if self.engines is not None else 0)
        return out

    async def aclose(self) -> None:
        await close_clients([s.client for s in self.slots])

    def close(self) -> None:
        if self.engines is not None:
            self.engines.close()
