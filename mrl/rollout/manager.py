"""Rollout manager: GRPO groups over several SGLang engines, partial rollouts, per-token versions.

    mgr = RolloutManager([EngineClient(u) for u in urls], sampling=SamplingSpec(max_new_tokens=64),
                         codec=RoutesCodec.from_bridge(bridge))
    samples = await mgr.generate_group(prompt_ids, n=8, group_id=0)

Each sample is its own request (own rid: abortable, own logprobs and routes). Dispatch goes to the
healthy engine with the fewest requests in flight, under a per-engine concurrency limit. An aborted
request (``/abort_request``, or a pause in abort mode for a weight update) returns its partial output;
the sample is resubmitted as prompt + partial with the remaining budget, and blocks in the engine
until it continues -- so partial rollouts survive weight updates, and each token keeps the version
that produced it. A dead or hung engine is taken out of rotation and its samples go to the others.

Hung engines (stopped, wedged: the port still accepts connections, nothing answers): an engine whose
requests have gone ``probe_timeout_s`` without any answer is probed (``client.liveness``), and so is one
that does not answer a drain's abort at once; when the probe fails, every call in flight there is
abandoned (``EngineHung``) and its sample resumes on another engine, as for a killed engine -- so a
hung engine holds neither the rollouts nor a drain.

Routes: each call asks only for the rows its input adds (``routed_experts_start_len`` = rows the sample
already holds, SGLang 0.5.14); a resumed segment or a later turn of an episode appends its rows, so no
call returns the whole history again -- unless the weights may have changed since the sample's rows were
routed (a drain for a weight sync came between, or a newer LoRA adapter serves it): the engine then
recomputes the whole prefix under the new weights (its cache was flushed, or is keyed on the adapter),
routing it anew, and the call asks for every row and replaces the sample's. Replaying the old rows would
make the trainer compute the prefix with routes the engine no longer used, so even the tokens sampled by
the trainer's own weights would differ from the engine's logprobs. ``generate_turn`` drives one model
turn of a multi-turn episode (``mrl.rollout.multiturn``) with the same machinery.

LoRA (``adapters``, ``mrl.rollout.lora.AdapterRouter``): each call names the newest adapter version loaded
on every engine, and its tokens get that version (the policy version is the adapter's; the engine's own
weight version stays the base's). An engine that answers that it never loaded the adapter lost it (a
restart behind the same address): it is taken out of rotation like a dead one.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mrl.sglang.client import EngineClient, liveness, watched
from mrl.rollout.lora import AdapterRouter
from mrl.sglang.protocol import EngineHTTPError, EngineHung, EngineProtocolError, EngineUnavailable, GenerateOutput
from mrl.rollout.sample import Sample, SamplingSpec
from mrl.routing.codec import RoutesCodec, RoutesError
from mrl.routing.sampling_mask import engine_support


ROUTES_WEIGHTS = "routes_weights"
"""``Sample.metadata`` key: which weights routed the sample's rows (drains so far, LoRA adapter version)."""


class NoEngineAvailable(RuntimeError):
    pass


class InflightVersionsMissing(ValueError):
    """An engine did not tag its tokens with their versions while syncs keep requests running: fails the sample."""


@dataclass
class _Slot:
    client: EngineClient
    sem: asyncio.Semaphore
    inflight: int = 0
    healthy: bool = True
    failures: int = 0
    served: int = 0
    """Calls answered (segments), for per-engine accounting."""
    progress: float = 0.0
    """Loop time of the last answer from this engine, or of the start of its first call in flight since."""
    why: str | None = None
    """Why it was taken out of rotation."""
    gone: asyncio.Future | None = field(default=None, repr=False)
    """Done (with ``why``) once it is taken out: its calls in flight stop waiting on it."""
    probing: asyncio.Task | None = field(default=None, repr=False)
    """The liveness probe in progress, shared by every call waiting on this engine."""

    def gone_future(self) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        if self.gone is None or self.gone.get_loop() is not loop:  # managers outlive the loops of tests
            self.gone = loop.create_future()
            if not self.healthy:
                self.gone.set_result(self.why)
        return self.gone


@dataclass
class RolloutStats:
    submitted: int = 0
    completed: int = 0
    failed: int = 0
    segments: int = 0
    aborted_segments: int = 0
    retries: int = 0
    engine_failures: int = 0
    prompt_tokens: int = 0
    """Input tokens of the answered calls, and of those the engine's radix cache already held: their
    ratio is the prefix-cache hit rate (turns and resumed segments continue a cached prefix)."""
    cached_tokens: int = 0
    errors: list[str] = field(default_factory=list)


class RolloutManager:
    def __init__(self, clients: list[EngineClient], *, sampling: SamplingSpec, codec: RoutesCodec | None = None,
                 max_inflight_per_engine: int = 8, max_retries: int = 3, run_id: str | None = None,
                 top_logprobs_num: int = 0, adapters: AdapterRouter | None = None, probe_timeout_s: float = 15.0,
                 vocab_size: int | None = None, inflight_updates: bool = False):
        """``top_logprobs_num`` > 0: ask for that many top logprobs per token and rebuild each token's
        sampling support from them (Keep Sampling Mask, ``mrl.routing.sampling_mask``). ``adapters``: LoRA
        runs, one router shared by every manager on these engines. ``probe_timeout_s``: an engine with
        requests in flight and no answer for this long is probed, and judged hung when the probe is not
        answered within it (``weight_sync.probe_timeout_s``). ``vocab_size``: a reply with a token id at or
        above it is refused (the sample retried elsewhere, counted), never trained on. ``inflight_updates``:
        weight syncs keep requests running in the engines (``weight_sync.pause_mode`` retract / in_place), so one
        call's tokens may come from several versions: each reply must tag every token with its version (mrl's
        engines do), and every call asks for all its route rows."""
        if probe_timeout_s <= 0:
            raise ValueError(f"probe_timeout_s must be > 0, got {probe_timeout_s}")
        self.probe_timeout_s = probe_timeout_s
        self.vocab_size = vocab_size
        if not clients:
            raise ValueError("RolloutManager needs at least one engine client")
        self._per_engine = max_inflight_per_engine
        self.slots = [_Slot(c, asyncio.Semaphore(max_inflight_per_engine)) for c in clients]
        self.sampling = sampling
        self.codec = codec
        self.max_retries = max_retries
        self.top_logprobs_num = top_logprobs_num
        self.inflight_updates = inflight_updates
        self.run_id = run_id or uuid.uuid4().hex[:8]
        self.adapters = adapters
        self._holding = False
        self.stats = RolloutStats()
        self._seq = itertools.count()
        self._gate = asyncio.Event()  # cleared while drained for a weight sync: no request may start
        self._gate.set()
        self._drains = 0
        """Drains so far: each may precede new weights (and a flushed cache)."""

    def add_engine(self, client: EngineClient) -> None:
        """A new engine (a restarted one, its weights already current) takes requests from now on. Call it
        on the loop that runs the manager."""
        self.slots.append(_Slot(client, asyncio.Semaphore(self._per_engine)))
        if self.adapters is not None:
            self.adapters.add_engine(client)

    def set_adapter(self, name: str, version: int) -> None:
        """LoRA: new calls use adapter ``name`` (policy version ``version``), loaded on every engine
        already; the previous one is unloaded from each engine once its calls there are back. Call it on
        the loop that runs the manager."""
        if self.adapters is None:
            raise RuntimeError("set_adapter: this manager was built without an AdapterRouter (LoRA off)")
        self.adapters.set_current(name, version, [s.client for s in self.slots])

    # -- dispatch -------------------------------------------------------------------------------
    def _pick(self) -> _Slot:
        healthy = [s for s in self.slots if s.healthy]
        if not healthy:
            raise NoEngineAvailable(f"no healthy engine left: {[s.client.url for s in self.slots]}")
        return min(healthy, key=lambda s: s.inflight)

    async def generate_group(self, prompt_ids: list[int], n: int, group_id: int,
                             max_new_tokens: int | list[int] | None = None) -> list[Sample]:
        """``max_new_tokens``: this prompt's budget (a dataset field), or one per sample of the group;
        else the sampling default."""
        budgets = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * n
        if len(budgets) != n:
            raise ValueError(f"group {group_id}: {len(budgets)} per-sample max_new_tokens for {n} samples")
        samples = [Sample(prompt_ids=list(prompt_ids), group_id=group_id, index=i,
                          max_new_tokens=b or self.sampling.max_new_tokens) for i, b in enumerate(budgets)]
        return list(await asyncio.gather(*(self.run_sample(s) for s in samples)))

    async def run_sample(self, sample: Sample) -> Sample:
        """Drive one sample to completion (or to a counted error). Never raises for engine faults."""
        self.stats.submitted += 1
        try:
            while not sample.done:
                if sample.remaining <= 0:
                    sample.finish_reason = "length"
                    break
                if (finish := await self._one_call(sample, sample.remaining)) is not None:
                    sample.finish_reason = finish
        except NoEngineAvailable as e:
            sample.error = str(e)
        if sample.error is None:
            sample.check()
            self.stats.completed += 1
        else:
            self.stats.failed += 1
            self.stats.errors.append(sample.error)
        return sample

    async def generate_turn(self, sample: Sample, max_new_tokens: int) -> str:
        """One model turn of a multi-turn episode: generate after ``sample.tokens`` (the conversation so
        far) until a stop token or ``max_new_tokens``, across aborts, pauses and engine failures like a
        single-turn sample. Returns the turn's finish type ("stop" | "length"); on failure
        ``sample.error`` is set (and "" returned). The episode's own finish is the caller's."""
        if max_new_tokens < 1:
            raise ValueError(f"generate_turn: max_new_tokens must be >= 1, got {max_new_tokens}")
        start = len(sample.response_ids)
        try:
            while sample.error is None:
                budget = max_new_tokens - (len(sample.response_ids) - start)
                if budget <= 0:
                    return "length"
                if (finish := await self._one_call(sample, budget)) is not None:
                    return finish
        except NoEngineAvailable as e:
            sample.error = str(e)
        return ""

    async def _one_call(self, sample: Sample, budget: int) -> str | None:
        """One /generate for ``sample`` of at most ``budget`` new tokens, applied to it. Returns the
        finish type when the call finished ("stop" | "length"), None when it was aborted or failed
        (the caller calls again; a failure that cannot be retried sets ``sample.error``)."""
        slot = self._pick()
        rid = f"{self.run_id}-g{sample.group_id}-s{sample.index}-{next(self._seq)}"
        inputs = sample.tokens
        async with slot.sem:
            await self._gate.wait()  # after the semaphore: a call queued on it must not slip past a drain
            if not slot.healthy:
                return None
            adapter = self.adapters.acquire(slot.client.url) if self.adapters is not None else None
            # read after the gate: a drain while this call waited there counts
            weights = f"{self._drains}:{adapter[1] if adapter else ''}"
            start_row = sample.route_rows if self.codec is not None and not self.inflight_updates else 0
            if start_row and sample.metadata.get(ROUTES_WEIGHTS) != weights:
                start_row = 0  # the prefix is routed anew: every row, replacing the sample's
            loop = asyncio.get_running_loop()
            if not slot.inflight:  # the engine owes no answer yet: its silence is counted from now
                slot.progress = loop.time()
            slot.inflight += 1
            try:
                params = self.sampling.to_request(budget)
                if self.sampling.seed is not None:  # a function of the sample, not of timing or engine
                    params["sampling_seed"] = (self.sampling.seed * 1_000_003 + sample.group_id * 10_007
                                               + sample.index * 101 + sample.num_segments) % (1 << 31)
                out = await self._answer(slot, slot.client.generate(
                    inputs, params, rid=rid, return_logprob=True, return_routed_experts=self.codec is not None,
                    top_logprobs_num=self.top_logprobs_num, routed_experts_start_len=start_row or None,
                    lora_path=adapter[0] if adapter else None))
            except (EngineUnavailable, EngineProtocolError) as e:
                # crash, hang or garbage: take the engine out, retry the sample elsewhere
                self._evict(slot, str(e))
                slot.failures += 1
                self.stats.engine_failures += 1
                self._retry_or_fail(sample, e)
                return None
            except EngineHTTPError as e:
                if adapter is not None and "never been loaded" in str(e):  # it lost its adapters: restarted
                    self._evict(slot, str(e))
                    slot.failures += 1
                    self.stats.engine_failures += 1
                    self._retry_or_fail(sample, e)
                    return None
                sample.error = str(e)  # the request itself is bad (400): retrying cannot help
                return None
            finally:
                slot.inflight -= 1
                slot.progress = loop.time()
                if adapter is not None:
                    self.adapters.release(slot.client.url, adapter)
        slot.served += 1
        try:
            return self._apply(sample, inputs, out, budget, start_row, adapter[1] if adapter else None, weights)
        except InflightVersionsMissing as e:  # every reply of that engine lacks them: retrying cannot help
            sample.error = str(e)
            return None
        except (RoutesError, ValueError) as e:
            self._retry_or_fail(sample, e)
            return None

    async def _answer(self, slot: _Slot, call) -> Any:
        """Await ``call`` (a request to ``slot``'s engine). Every ``probe_timeout_s`` the engine has had
        calls in flight without answering any, it is probed (one probe shared by its calls); a failed probe
        takes it out of rotation, and then every call waiting on it raises ``EngineHung`` at once instead of
        waiting out its own limit (an hour for /generate: generation may legitimately be long)."""
        task = asyncio.ensure_future(call)
        gone = slot.gone_future()
        loop = asyncio.get_running_loop()
        try:
            while True:
                done, _ = await asyncio.wait({task, gone}, timeout=self.probe_timeout_s,
                                             return_when=asyncio.FIRST_COMPLETED)
                if task in done:
                    return task.result()
                if gone.done():
                    raise EngineHung(slot.client.url, "/generate", f"call abandoned: {gone.result()}")
                if loop.time() - slot.progress >= self.probe_timeout_s:
                    await self._probe(slot)
        finally:
            if not task.done():
                task.cancel()

    async def _probe(self, slot: _Slot) -> None:
        """Probe ``slot``'s engine (``client.liveness``), joining a probe already under way; take it out of
        rotation when the probe fails."""
        if slot.probing is None or slot.probing.done() or slot.probing.get_loop() is not asyncio.get_running_loop():
            slot.probing = asyncio.ensure_future(liveness(slot.client, self.probe_timeout_s))
        why = await asyncio.shield(slot.probing)  # a caller cancelled must not cancel the others' probe
        if why is None:
            slot.progress = asyncio.get_running_loop().time()  # up, only busy: next probe one period later
        else:
            self._evict(slot, f"judged hung: {why}")

    def _evict(self, slot: _Slot, why: str) -> None:
        """Out of rotation for good; its calls in flight end now (``_answer``) and their samples resume
        elsewhere."""
        if slot.healthy:
            slot.healthy, slot.why = False, why
        if slot.gone is not None and not slot.gone.done():
            slot.gone.set_result(slot.why)

    def _retry_or_fail(self, sample: Sample, err: Exception) -> None:
        sample.num_retries += 1
        self.stats.retries += 1
        if sample.num_retries > self.max_retries:
            sample.error = f"gave up after {self.max_retries} retries: {err}"

    def _apply(self, sample: Sample, inputs: list[int], out: GenerateOutput, budget: int,
               start_row: int, adapter_version: int | None = None, weights: str | None = None) -> str | None:
        new = out.output_ids
        if len(new) > budget:
            raise ValueError(f"engine returned {len(new)} tokens for a budget of {budget}")
        if self.vocab_size is not None and new and max(new) >= self.vocab_size:
            raise ValueError(f"engine returned token id {max(new)}, outside the vocabulary of {self.vocab_size}")
        versions = self._versions(out, adapter_version)
        routes = None
        if self.codec is not None and new:
            if out.routed_experts is None:
                raise RoutesError(f"no routed_experts in the reply for {out.rid} (engine started without "
                                  "--enable-return-routed-experts?)")
            # the reply holds rows start_row .. len(inputs) + len(new) - 2: decoded as a sequence that
            # starts at start_row, it has the row count the codec checks
            routes = self.codec.decode(out.routed_experts, prompt_len=len(inputs) - start_row,
                                       response_len=len(new))
        if self.top_logprobs_num and new:
            sp = self.sampling
            ids, mass = engine_support(out.output_top_logprobs or [[]] * len(new), temperature=sp.temperature,
                                       top_k=sp.top_k, top_p=sp.top_p, min_p=sp.min_p)
            sample.support += ids
            sample.support_log_mass += mass
        sample.response_ids += new
        sample.response_logprobs += out.output_logprobs or []
        sample.versions += versions
        sample.loss_mask += [1] * len(new)
        if routes is not None:
            fresh = sample.routes is None or start_row == 0
            sample.routes = routes if fresh else np.concatenate([sample.routes, routes])
            sample.metadata[ROUTES_WEIGHTS] = weights
        sample.num_segments += 1
        self.stats.segments += 1
        self.stats.prompt_tokens += out.prompt_tokens or 0
        self.stats.cached_tokens += out.cached_tokens or 0
        if out.finish is not None and out.finish.aborted:
            sample.num_aborts += 1
            self.stats.aborted_segments += 1
            return None
        return out.finish.type if out.finish is not None else None

    def _versions(self, out: GenerateOutput, adapter_version: int | None) -> list[int]:
        """The version of each token of ``out``: the engine's tag per token where it sends them (mrl's engines),
        else the reply's version, which is every token's when no sync can change the weights under a running
        request (abort mode). LoRA: the adapter's, whatever the base weights' tags say."""
        n = len(out.output_ids)
        if adapter_version is not None:
            return [adapter_version] * n
        tags = out.token_versions
        if tags is None and self.inflight_updates:
            raise InflightVersionsMissing(
                f"engine reply for {out.rid} has no per-token weight versions: weight_sync.pause_mode retract / "
                "in_place keeps requests running across a sync, so one call's tokens may come from several "
                "versions, and only engines with mrl's patches (started by mrl or `mrl engine`) tag them")
        try:
            return [int(v) for v in tags] if tags is not None else [int(out.weight_version)] * n
        except ValueError:
            raise ValueError(f"weight version {tags or out.weight_version!r} is not an integer (mrl numbers "
                             "versions)") from None

    # -- engine-wide control (weight updates) ---------------------------------------------------
    async def drain(self, timeout: float = 60.0) -> int:
        """Before a weight sync: hold new requests, abort the in-flight ones and wait until they have
        returned (partial outputs kept; the samples resume after ``undrain``). Returns how many were
        in flight.

        Why not just SGLang's ``pause_generation(mode=abort)``: in 0.5.10 it re-checks for running
        requests only once a second (``asyncio.sleep(1.0)``), so every sync with requests in flight
        cost >= 1 s. Aborts land within one decode step; they are re-sent until every call is back
        (a request that reached the engine after an abort would otherwise run to completion)."""
        self._gate.clear()
        self._drains += 1
        if self.adapters is not None and not self._holding:  # engines may be paused next: no unload
            self._holding = True
            self.adapters.hold()
        n = sum(s.inflight for s in self.slots)
        deadline = asyncio.get_running_loop().time() + timeout
        while busy := [s for s in self.slots if s.inflight and s.healthy]:
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"drain: {sum(s.inflight for s in busy)} requests still in flight on "
                                   f"{[s.client.url for s in busy]} {timeout:.0f} s after abort_all")
            await asyncio.gather(*(self._abort_all(s) for s in busy))
            await asyncio.sleep(0.02)
        return n

    async def _abort_all(self, slot: _Slot) -> None:
        """Abort every request on ``slot``'s engine. One that does not answer at once is probed meanwhile
        (``client.watched``): a hung or dead engine is taken out of rotation, so its calls come back
        (their samples resume elsewhere after ``undrain``) instead of holding the drain to its limit."""
        try:
            await watched(slot.client, slot.client.abort(abort_all=True), "/abort_request",
                          probe_timeout_s=self.probe_timeout_s)
        except EngineUnavailable as e:  # refused, silent or 5xx: its requests cannot be aborted
            self._evict(slot, str(e))
        except Exception:  # noqa: BLE001 -- anything else (a 4xx): the next round aborts again, the deadline holds
            pass

    def undrain(self) -> None:
        self._gate.set()
        if self._holding:
            self._holding = False
            self.adapters.resume()
