"""The sync sequence every transport shares, and the factory of transports.

    transport, disk = make_transport(WeightTransport.distributed, model=..., layout=..., bridge=..., ...)
    syncer = EngineSync(transport, disk, layout, engines, rebuild=...)
    syncer.connect()
    report = syncer.sync("7")      # pause -> flush -> push -> repair through disk -> stamp -> continue
    syncer.close()
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from mrl.config.schema import WeightTransport
from mrl.megatron.collectives import CollectiveError, named
from mrl.megatron.parallel import Layout
from mrl.models.bridge import ModelBridge
from mrl.sglang.client import ClientTimeouts, EngineClient, close_clients, watched
from mrl.sglang.protocol import EngineHung
from mrl.weight_sync.disk import DiskTransport
from mrl.weight_sync.distributed import DistributedTransport, DistributedWeightSync
from mrl.weight_sync.tensor import TensorTransport
from mrl.sglang.endpoint import EngineEndpoint
from mrl.weight_sync.channel import SyncReport, WeightChannel
from mrl.weight_sync.transport import LoopThread, Transport, dead_engines, run_on

class NonFiniteWeights(RuntimeError):
    """Weights with a NaN or Inf, refused before they reach an engine or a checkpoint."""


def check_finite_weights(module: torch.nn.Module, what: str) -> None:
    """Raise ``NonFiniteWeights`` on every rank, naming the parameters, when any rank holds a non-finite
    weight: nothing non-finite is synced or checkpointed. The optimizer step skips non-finite updates
    (``Policy._step_if_finite``); this catches the rest (a weight corrupted in place, a loaded one).
    Collective: one MAX all-reduce (every rank checks its own shards); only when a norm was non-finite
    somewhere, a second one after the element-wise recheck and, when that confirms it, a gather of names."""
    named_params = list(module.named_parameters())
    # A NaN or Inf makes a tensor's L2 norm non-finite. The fused multi-tensor norm launches a handful of
    # kernels for the whole model, where a reduction per parameter launches one per tensor (an MoE layer
    # holds a weight per local expert): milliseconds of launches on a GPU at every sync. The norm also
    # overflows for finite values beyond about 1e19, so a tensor it flags is checked element by element.
    params = [p.detach() for _, p in named_params]
    norms = torch._foreach_norm(params, 2, dtype=torch.float32) if params else []
    suspect = torch.stack(norms).isfinite().logical_not() if norms else torch.zeros(0, dtype=torch.bool)
    flag = suspect.any().float().reshape(1)
    with named(f"the finite-weights check before {what}"):
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not flag.item():
        return
    mine = [n for (n, p), s in zip(named_params, suspect.tolist()) if s and not bool(p.isfinite().all())]
    bad = torch.tensor([float(bool(mine))], device=flag.device)
    with named(f"the finite-weights recheck before {what}"):
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if not bad.item():
        return
    everyone: list = [None] * dist.get_world_size()
    with named(f"the gather of non-finite weight names before {what}"):
        dist.all_gather_object(everyone, mine)
    names = {f"rank {r}: {n}" for r, ns in enumerate(everyone) for n in ns}
    raise NonFiniteWeights(f"{what} refused: the trainer holds non-finite (NaN/Inf) weights, "
                           f"{sorted(names)[:8]}{' ...' if len(names) > 8 else ''}; nothing was sent or written")


class SyncMismatch(RuntimeError):
    """After a sync, an engine's logprobs of the probe are not the trainer's (``weight_sync.verify``)."""


def verify_engines(module: torch.nn.Module, layout: Layout, engines: list[EngineEndpoint], *, vocab_size: int,
                   tol: float, version: str, seed: int = 0, probe_len: int = 32,
                   lora_path: str | None = None, timeout_s: float = 300.0) -> tuple[dict[str, float], dict]:
    """``weight_sync.verify``: teacher-forced logprobs of a fixed random probe, each engine's against the
    trainer's (both route naturally), after a sync. Collective. Returns ({url: max abs difference}, {url:
    error} of engines that could not be asked: a dead one is the next sync's to drop); raises
    ``SyncMismatch`` on every rank when an engine differs by more than ``tol``: it would generate every
    later sample from weights that are not the trainer's, and nothing else would show it. LoRA runs pass
    ``lora_path``, the adapter name of ``version`` (``mrl.sglang.wire.adapter_name``). An engine that
    does not answer its probe within ``timeout_s`` counts as unreachable (a one-token request: a hung
    engine must not hold every rank for the client's generation limit of an hour)."""
    from mrl.megatron import compat
    from mrl.megatron.forward import forward_logits, token_logprobs

    probe = torch.randint(0, vocab_size, (1, probe_len), generator=torch.Generator().manual_seed(seed))
    was_training = module.training
    module.eval()
    try:
        logits = forward_logits(module, layout, probe.to(compat.DEVICE))
    finally:
        module.train(was_training)
    mine = token_logprobs(logits, probe.to(logits.device), vocab_size)[0].tolist() if logits is not None else None
    box: list = [None] * dist.get_world_size()
    with named(f"the gather of the probe logprobs verifying weight sync v{version}"):
        dist.all_gather_object(box, mine)
    mine = next(x for x in box if x is not None)  # the last pipeline stage's
    result: list = [None]
    if layout.world_rank == 0:
        got: dict[str, list[float]] = {}

        async def probe_one(c: EngineClient) -> None:
            out = await c.generate(probe[0].tolist(), {"max_new_tokens": 1, "temperature": 0.0},
                                   rid=f"mrl-verify-v{version}-{abs(hash(c.url)):x}", logprob_start_len=0,
                                   lora_path=lora_path)
            got[c.url] = out.input_logprobs[1:]  # the first token has none

        errs = run_on(engines, probe_one, timeouts=ClientTimeouts(control=timeout_s, generate=timeout_s))
        result = [({url: max(abs(a - b) for a, b in zip(lps, mine)) for url, lps in got.items()}, errs)]
    with named(f"broadcast of the probe differences verifying weight sync v{version}", src=0):
        dist.broadcast_object_list(result, src=0)
    diffs, errs = result[0]
    bad = {url: d for url, d in diffs.items() if not d <= tol}
    if bad:
        raise SyncMismatch(f"weight sync v{version}: engines {sorted(bad)} disagree with the trainer on a fixed "
                           f"probe: max |logprob difference| {', '.join(f'{d:.3g}' for d in bad.values())} > "
                           f"weight_sync.verify_tol={tol} (every engine: {diffs}); their weights are not the "
                           "trainer's")
    return diffs, errs


class _Phases:
    """Seconds between consecutive ``mark`` calls, by the name of the phase each call closes."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._t = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._t
        self._t = now


class EngineSync(WeightChannel):
    """The sequence for one weight version, whatever the transport:
    pause(abort) + flush -> push -> engines that failed are reloaded from disk -> stamp -> continue.

    Partial rollouts survive: requests aborted by the pause come back to the rollout manager, which
    resumes them on the new weights (per-token versions tell the trainer which tokens are stale).

    An engine that fails a step is dropped when it is dead (``verdict``): killed, or hung -- a stopped
    or wedged server still accepts connections, so only a liveness probe with its own limit tells. A
    control call that does not return at once is probed meanwhile (``client.watched``), so a hung
    engine costs about ``probe_timeout_s``, not the call's limit."""

    pauses_engines = True

    def __init__(self, transport: Transport, disk: Transport, layout: Layout,
                 engines: list[EngineEndpoint], *, pause_mode: str = "abort", rebuild=None,
                 model: torch.nn.Module | None = None, probe_timeout_s: float = 15.0):
        """``rebuild(engines) -> (transport, disk)``: new channels for the engines still alive after
        one died mid-sync (its weight-update groups are broken for every member); None = fail instead.
        ``model``: checked for non-finite weights before every sync (``check_finite_weights``).
        ``probe_timeout_s``: ``weight_sync.probe_timeout_s``, the liveness probe's limit."""
        self.transport, self.disk, self.layout, self.engines = transport, disk, layout, engines
        self.pause_mode, self.rebuild, self.model = pause_mode, rebuild, model
        self.probe_timeout_s = probe_timeout_s
        self.dropped: list[str] = []
        self._hung: dict[str, str] = {}  # controller: engines a watched call already found hung, and why
        # controller: the pause/stamp/continue clients and their loop, kept from one sync to the next (no new
        # event loop, session and connection per call; connections live as long as keep-alive allows)
        self._io: LoopThread | None = None
        self._clients: dict[str, EngineClient] = {}

    def connect(self) -> None:
        t0 = time.monotonic()
        try:
            self.transport.connect()
        except (RuntimeError, TimeoutError) as e:  # the store's "1/2 clients joined", or a bare future timeout
            raise CollectiveError(f"rank {self.layout.world_rank}: creating the weight-update groups with engines "
                                  f"{[x.url for x in self.engines]} failed after {time.monotonic() - t0:.1f} s "
                                  f"(limit: weight_sync.timeout_s): {type(e).__name__}: {e}") from e

    def _on_engines(self, call) -> dict[str, str]:
        """``call(client)`` on every engine at once over the kept clients; {url: error}."""
        if self._io is None:
            self._io = LoopThread()
        gone = [self._clients.pop(u) for u in list(self._clients) if u not in {e.url for e in self.engines}]
        if gone:
            self._io.submit(close_clients(gone)).result(30)
        for e in self.engines:
            self._clients.setdefault(e.url, EngineClient(e))
        return run_on(self.engines, call, loop=self._io, clients=self._clients)

    def close(self) -> None:
        if self._io is not None:
            self._io.submit(close_clients(list(self._clients.values()))).result(30)
            self._io.close()
            self._io, self._clients = None, {}
        try:
            self.transport.close()
        except TimeoutError as e:  # the controller's wait for the engines' destroy requests: no message of its own
            raise CollectiveError(f"rank {self.layout.world_rank}: engines {[x.url for x in self.engines]} did not "
                                  "answer destroy_weights_update_group within weight_sync.timeout_s") from e

    def sync(self, version: str) -> SyncReport:
        t0 = time.perf_counter()
        phases = _Phases()
        if self.model is not None:  # before the engines pause: a refused sync leaves them serving the last weights
            check_finite_weights(self.model, f"weight sync v{version}")
        phases.mark("check")
        controller = self.layout.world_rank == 0
        errs = self._on_engines(self._pause) if controller else {}
        reasons = self.verdict(errs)  # collective: every rank learns which engines are gone
        dead = list(reasons)
        if controller and set(errs) - set(dead):
            raise RuntimeError(f"weight sync v{version}: could not pause engines (they answer a liveness probe, "
                               f"so they were not dropped): { {u: e for u, e in errs.items() if u not in dead} }")
        if dead:  # died or hung before the sync (mid-rollout): sync the others
            self._drop(dead, version, reasons)
        phases.mark("pause")
        try:
            stats = self.transport.push(version)
        except TimeoutError as e:  # the controller's wait for the engines' update requests: no message of its own
            raise CollectiveError(f"weight sync v{version}: engines {[x.url for x in self.engines]} did not answer "
                                  "every bucket request within weight_sync.timeout_s per bucket (one stopped "
                                  "mid-push?)") from e
        if not stats.ok and ((more := self.verdict(stats.failed_engines)) or stats.groups_broken):
            # died mid-sync, or a broadcast failed: its groups are broken for every member (the sender tore
            # them down so no engine waits in them); rebuild them without the dead, push again
            self._drop(list(more), version, more)
            dead += list(more)
            reasons |= more
            stats = self.transport.push(version)
        repaired: list[str] = []
        if not stats.ok and self.transport is not self.disk:  # never leave an engine on partial weights
            bad = [e for e in self.engines if e.url in stats.failed_engines]
            fix = self.disk.push(version, bad)
            if not fix.ok:
                raise RuntimeError(f"weight sync v{version}: {stats.failed_engines}; disk repair failed too: "
                                   f"{fix.failed_engines}")
            repaired = [e.url for e in bad]
        elif not stats.ok:
            raise RuntimeError(f"weight sync v{version} over disk failed: {stats.failed_engines}")
        stamped = set(stats.stamped) - set(repaired)
        phases.mark("push")
        errs = self._on_engines(lambda c: self._finish(c, version, c.url in stamped)) if controller else {}
        late = self.verdict(errs)  # hung after the push: the others hold the weights and go on
        if controller and set(errs) - set(late):
            raise RuntimeError(f"weight sync v{version}: could not stamp/continue engines: "
                               f"{ {u: e for u, e in errs.items() if u not in late} }")
        if late:
            self._drop(list(late), version, late)
            dead += list(late)
            reasons |= late
        phases.mark("finish")
        with named(f"the barrier closing weight sync v{version}"):
            dist.barrier()
        phases.mark("barrier")
        return SyncReport(version=version, transport=self.transport.name, seconds=time.perf_counter() - t0,
                          push_seconds=stats.seconds, bytes_sent=stats.bytes_sent, bytes_in_place=stats.bytes_in_place,
                          failed_engines=stats.failed_engines, repaired_from_disk=repaired, dropped_engines=dead,
                          dead_reasons=reasons, stamped_with_push=sorted(stamped), phase_seconds=phases.seconds)

    def add(self, new: list[EngineEndpoint]) -> None:
        """Engines joining (restarted ones): new channels with every engine; the next ``sync`` pushes to all
        of them. Collective."""
        if self.rebuild is None:
            raise RuntimeError("EngineSync.add needs a rebuild function")
        self._rechannel(self.engines + list(new))

    def _drop(self, dead: list[str], version: str, why: dict[str, str]) -> None:
        """New channels for the engines still alive (all of them when ``dead`` is empty: broken groups)."""
        if self.rebuild is None or len(dead) == len(self.engines):
            raise RuntimeError(f"weight sync v{version}: " + (f"engines died or hung: {dead}" if dead else
                               "a broadcast failed and its groups cannot be rebuilt") + f" ({why})")
        if self.layout.world_rank == 0:
            for url in dead:
                print(f"[mrl] weight sync v{version}: engine {url} dropped: {why.get(url, 'dead')}", flush=True)
        self.dropped += dead
        self.transport.forget(dead)  # no teardown requests to them: a hung engine would hold each to its limit
        self._rechannel([e for e in self.engines if e.url not in dead])

    def _rechannel(self, engines: list[EngineEndpoint]) -> None:
        """Tear the channels down and build them again for ``engines`` (per-run group names: never reused)."""
        self.transport.close()
        self.engines = engines
        self.transport, self.disk = self.rebuild(engines)
        self.connect()

    def verdict(self, failed: dict[str, str]) -> dict[str, str]:
        """Of the engines in ``failed`` (the controller's {url: error}), those that are dead, with why:
        hung in a watched call already, or failing a liveness probe now (``client.liveness``: refused, no
        answer within ``probe_timeout_s``, or 5xx to every probe). Collective: every rank gets rank 0's
        verdict. Engines that answer are alive: their failure is an error of its own."""
        dead: dict[str, str] = {}
        if self.layout.world_rank == 0 and failed:
            dead = {u: self._hung[u] for u in failed if u in self._hung}
            dead |= dead_engines([u for u in failed if u not in dead], self.probe_timeout_s)
        self._hung.clear()
        if dist.get_world_size() == 1:  # no other rank to tell
            return dead
        box = [dead]
        with named("broadcast of the engines found dead during a weight sync", src=0):
            dist.broadcast_object_list(box, src=0)
        return box[0]

    async def _watch(self, c: EngineClient, call, endpoint: str):
        """``call`` on engine ``c``, probed meanwhile when slow; a hung engine is remembered for ``verdict``."""
        try:
            return await watched(c, call, endpoint, probe_timeout_s=self.probe_timeout_s)
        except EngineHung as e:
            self._hung[c.url] = str(e)
            raise

    async def _pause(self, c: EngineClient) -> None:
        await self._watch(c, c.pause(self.pause_mode), "/pause_generation")
        await self._watch(c, c.flush_cache(), "/flush_cache")

    async def _finish(self, c: EngineClient, version: str, stamped: bool = False) -> None:
        if not stamped:  # else the push's own request set it
            await self._watch(c, c.update_weight_version(version, abort_all_requests=False), "/update_weight_version")
        await self._watch(c, c.resume(), "/continue_generation")


def make_transport(kind: WeightTransport, *, model: torch.nn.Module, layout: Layout, bridge: ModelBridge,
                   padded_vocab: int, engines: list[EngineEndpoint], bucket_bytes: int, export_dir: str | None,
                   config_src: str, dtype: str = "float32", timeout_s: float = 300.0,
                   group_prefix: str = "mrl", fp8: bool = False, fp8_ignore: tuple[str, ...] = (),
                   **executor_kw) -> tuple[Transport, Transport]:
    """The configured transport and the disk transport that repairs it (the same object for disk). ``fp8``:
    the engines serve block-FP8 weights (``rollout.quantization=fp8``), with ``fp8_ignore``'s modules in
    high precision (``rollout.fp8_ignore``); every transport sends them so."""
    disk = DiskTransport(model=model, layout=layout, bridge=bridge, padded_vocab=padded_vocab, engines=engines,
                         export_dir=export_dir, config_src=config_src, fp8_dtype=getattr(torch, dtype) if fp8 else None,
                         fp8_ignore=fp8_ignore)
    if kind == WeightTransport.disk:
        return disk, disk
    ex = DistributedWeightSync(model=model, layout=layout, bridge=bridge, padded_vocab=padded_vocab,
                               engines=engines, bucket_bytes=bucket_bytes, dtype=dtype, timeout_s=timeout_s,
                               group_prefix=group_prefix, fp8=fp8, fp8_ignore=fp8_ignore, **executor_kw)
    if kind == WeightTransport.tensor:
        return TensorTransport(ex), disk
    return DistributedTransport(ex), disk
