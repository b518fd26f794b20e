"""Adapter-only weight sync for LoRA runs: each policy version is a new SGLang adapter, ``policy@v{n}``.

    sync = AdapterSync(urls, spec=lora_engine_spec(cfg), timeout_s=cfg.weight_sync.timeout_s)
    report = sync.push(tensors, adapter_config, version=7)  # trainer rank 0, after the optimizer step
    rollout.set_adapter(report.name, 7)                     # new requests use v7; v6 unloaded when idle
    sync.add_engines([url]); rollout.add_engine(url)        # a restarted engine: the current adapter first

The train loop drives this through ``AdapterChannel`` (every trainer rank; the calls of ``FullWeightChannel``).

``tensors`` are the full (unsharded) HF PEFT tensors, ``base_model.model.model.layers.L.self_attn.q_proj.
lora_A.weight`` ..., and ``adapter_config`` the ``adapter_config.json`` dict. The base weights never change
in a LoRA run, so nothing is paused, flushed or re-stamped: an engine serves every live version at once,
each request on the version it started with (the radix cache keys on the adapter, so no flush either).

Transport: ``POST /load_lora_adapter_from_tensors`` with a base64 pickle payload that names only what
SGLang's ``SafeUnpickler`` allows (``serialize_adapter``: anything else crashes the server's scheduler, as
does a ForkingPickler payload of CPU tensors, whose file descriptors the server's TP ranks cannot reach).
With ``export_dir`` (the disk transport), the adapter is written there as a PEFT directory and the engines
load it by path, for adapters too large to send as JSON. Loading a name twice is refused by SGLang, hence
one name per version.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import io
import json
import os
import pickle
import re
import shutil
import time
from dataclasses import dataclass, field

import torch

from mrl.config.lora_engine import LoraEngineSpec
from mrl.megatron.collectives import broadcast_object
from mrl.sglang.client import ClientTimeouts, EngineClient
from mrl.sglang.endpoint import EngineEndpoint
from mrl.sglang.protocol import EngineError, EngineHTTPError
from mrl.sglang.wire import NAME_PREFIX, adapter_name, adapter_version
from mrl.weight_sync.channel import SyncReport, WeightChannel
from mrl.weight_sync.checks import check_finite_weights

_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


class AdapterSyncError(RuntimeError):
    """Engines that did not take an adapter version; ``loaded`` did (they serve it to nobody until the
    rollout side switches to it)."""

    def __init__(self, name: str, failed: dict[str, str], loaded: list[str]):
        super().__init__(f"adapter {name}: " + "; ".join(f"engine {u}: {e}" for u, e in failed.items()))
        self.name, self.failed, self.loaded = name, failed, loaded


def check_adapter_tensors(tensors: dict[str, torch.Tensor], config: dict, *, where: str = "adapter") -> int:
    """Refuse tensors that do not form the PEFT adapter ``config`` describes (names, pairs, shapes, values);
    returns their bytes. SGLang would otherwise load a partial adapter without a word, or fail later."""
    r, targets = config.get("r"), config.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    if not tensors:
        raise ValueError(f"{where}: no tensors")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for k, t in tensors.items():
        m = _KEY.match(k)
        if m is None:
            raise ValueError(f"{where}: {k!r} is not a PEFT LoRA name (base_model.model.<module>.lora_A/B.weight)")
        leaf = m["module"].rsplit(".", 1)[-1]
        if leaf not in targets:
            raise ValueError(f"{where}: {k!r}: module {leaf!r} is not in target_modules {targets}")
        if not isinstance(t, torch.Tensor) or t.ndim != 2 or not t.is_floating_point():
            raise ValueError(f"{where}: {k!r} must be a 2-D floating-point tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
        pairs.setdefault(m["module"], {})[m["ab"]] = t
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: {module} has lora_{''.join(ab)} without lora_{'B' if 'A' in ab else 'A'}")
        if ab["A"].shape[0] != r or ab["B"].shape[1] != r:
            raise ValueError(f"{where}: {module}: lora_A {tuple(ab['A'].shape)} / lora_B {tuple(ab['B'].shape)} "
                             f"do not have rank r={r} (A is [r, in], B is [out, r])")
    bad = [k for k, t in tensors.items() if not torch.isfinite(t).all()]
    if bad:
        raise ValueError(f"{where}: non-finite (NaN/Inf) values in {bad[:4]}; nothing was sent")
    return sum(t.numel() * t.element_size() for t in tensors.values())


class _TensorPickler(pickle.Pickler):
    """Pickles a tensor as its raw bytes rebuilt by ``torch.frombuffer`` + ``torch.reshape``, not through
    torch's storage reduction: megatron-core replaces ``torch.storage._load_from_bytes`` on import, so a
    trainer's plain pickle names ``megatron.core.safe_globals.safe_load_from_bytes``, which SGLang's
    ``SafeUnpickler`` refuses by crashing its scheduler. Only builtins, functools and torch are named."""

    def reducer_override(self, obj):
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        t = obj.detach().to("cpu").contiguous()
        if t.numel() == 0:
            raise ValueError(f"cannot send an empty tensor of shape {tuple(t.shape)}")
        raw = bytearray(t.view(-1).view(torch.uint8).numpy().tobytes())
        return torch.reshape, (_FromBuffer(raw, t.dtype), tuple(t.shape))


class _FromBuffer:
    def __init__(self, raw: bytearray, dtype: torch.dtype):
        self.raw, self.dtype = raw, dtype

    def __reduce__(self):
        return functools.partial(torch.frombuffer, dtype=self.dtype), (self.raw,)


def serialize_adapter(tensors: dict[str, torch.Tensor]) -> str:
    """``serialized_tensors`` of ``/load_lora_adapter_from_tensors``: base64 of a pickle of CPU tensors that
    SGLang's restricted unpickler accepts from any process (``_TensorPickler``; never ForkingPickler, see
    the module doc)."""
    buf = io.BytesIO()
    _TensorPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(dict(tensors))
    return base64.b64encode(buf.getvalue()).decode()


def write_peft_dir(path: str, tensors: dict[str, torch.Tensor], config: dict) -> str:
    """``adapter_model.safetensors`` + ``adapter_config.json`` at ``path`` (written atomically: a directory
    renamed into place, so an engine never reads a half-written adapter)."""
    from safetensors.torch import save_file

    tmp = f"{path}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file({k: t.detach().to("cpu").contiguous() for k, t in tensors.items()},
              os.path.join(tmp, "adapter_model.safetensors"))
    with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path


@dataclass
class AdapterSyncReport:
    name: str
    version: int
    seconds: float
    """Wall time of the whole push: checks, serialization or export, every engine's load."""
    tensor_bytes: int
    payload_bytes: int
    """Bytes on the wire to each engine (the base64 payload), or written to disk once."""
    engines: list[str]
    engine_seconds: dict[str, float] = field(default_factory=dict)
    """Per engine: its load call, request to answer."""
    mode: str = "tensors"
    stale_unloaded: dict[str, list[str]] = field(default_factory=dict)
    """Per engine: adapters of an earlier run found there and unloaded at first contact."""


class AdapterSync:
    """Pushes adapter versions into engines (trainer rank 0). Blocking; every HTTP call has a limit."""

    def __init__(self, urls: list[str], *, spec: LoraEngineSpec | None = None, timeout_s: float = 300.0,
                 export_dir: str | None = None, api_key: str | None = None, admin_key: str | None = None):
        """``spec``: the engines' launch spec, against which every adapter is checked before it is sent
        (None: the engines judge). ``export_dir``: load by path from there (disk transport), else send
        the tensors. Keys: the run's (``$MRL_ENGINE_KEYS_FILE``) unless given."""
        self.urls = list(urls)
        self.spec, self.timeout_s, self.export_dir = spec, timeout_s, export_dir
        self._keys = (api_key, admin_key)
        self.current: tuple[str, int] | None = None
        self._last: tuple[dict[str, torch.Tensor], dict] | None = None
        self._known: set[str] = set()  # engines whose earlier-run adapters were cleared

    @property
    def mode(self) -> str:
        return "disk" if self.export_dir else "tensors"

    def _client(self, url: str) -> EngineClient:
        t = ClientTimeouts(connect=min(10.0, self.timeout_s), control=min(60.0, self.timeout_s),
                           weight_update=self.timeout_s)
        return EngineClient(url, timeouts=t, api_key=self._keys[0], admin_key=self._keys[1])

    def push(self, tensors: dict[str, torch.Tensor], config: dict, version: int) -> AdapterSyncReport:
        """Load policy version ``version`` into every engine as ``adapter_name(version)``. Raises
        ``AdapterSyncError`` naming each engine that did not take it (the rollout side must not switch
        then); a push of the current version again is a no-op."""
        name = adapter_name(version)
        if self.current is not None and version < self.current[1]:
            raise ValueError(f"adapter {name}: version {version} is older than the engines' current "
                             f"{self.current[0]}")
        if self.current == (name, version):
            return AdapterSyncReport(name=name, version=version, seconds=0.0, tensor_bytes=0, payload_bytes=0,
                                     engines=[], mode=self.mode)
        if self.spec is not None:
            self.spec.check_adapter(config, where=f"adapter {name}")
        report = self._load(self.urls, tensors, config, name, version)
        self.current, self._last = (name, version), (tensors, config)
        if self.export_dir:  # the engines hold their own copies now; keep only the current for restarts
            root = os.path.join(self.export_dir, "lora")
            for d in os.listdir(root):
                if d != f"v{version}" and re.fullmatch(r"v\d+", d):
                    shutil.rmtree(os.path.join(root, d), ignore_errors=True)
        return report

    def add_engines(self, urls: list[str]) -> AdapterSyncReport | None:
        """Engines that join (restarted ones) get the current adapter before they serve a request.
        None when there is no adapter yet (they serve the base model, policy version 0)."""
        new = [u for u in urls if u not in self.urls]
        if self.current is None or self._last is None:
            self.urls += new
            return None
        report = self._load(urls, *self._last, *self.current)
        self.urls += new
        return report

    def remove_engines(self, urls: list[str]) -> None:
        self.urls = [u for u in self.urls if u not in urls]
        self._known -= set(urls)

    def _load(self, urls: list[str], tensors, config, name: str, version: int) -> AdapterSyncReport:
        t0 = time.perf_counter()
        nbytes = check_adapter_tensors(tensors, config, where=f"adapter {name}")
        if self.export_dir:
            path = write_peft_dir(os.path.join(self.export_dir, "lora", f"v{version}"), tensors, config)
            payload_bytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
            send = lambda c: c.load_lora_adapter(name, path)  # noqa: E731
        else:
            payload = serialize_adapter(tensors)
            payload_bytes = len(payload)
            send = lambda c: c.load_lora_adapter_from_tensors(name, config, payload)  # noqa: E731
        per: dict[str, float] = {}
        stale: dict[str, list[str]] = {}

        async def one(url: str) -> str | None:
            c = self._client(url)
            try:
                if url not in self._known:
                    stale[url] = await self._clear_stale(c, keep=name)
                    self._known.add(url)
                s = time.perf_counter()
                try:
                    held = await send(c)
                except EngineHTTPError as e:
                    if "already loaded" not in str(e):
                        raise
                    held = await c.lora_adapters()  # a retry after a timeout that did load it
                per[url] = time.perf_counter() - s
                if name not in held:
                    return f"answered success but does not list {name} among its adapters {held}"
                return None
            except EngineError as e:
                return str(e)
            finally:
                await c.close()

        async def go():
            return await asyncio.gather(*(one(u) for u in urls))

        errs = asyncio.run(go())
        failed = {u: e for u, e in zip(urls, errs) if e is not None}
        if failed:
            raise AdapterSyncError(name, failed, [u for u in urls if u not in failed])
        return AdapterSyncReport(name=name, version=version, seconds=time.perf_counter() - t0, tensor_bytes=nbytes,
                                 payload_bytes=payload_bytes, engines=list(urls), engine_seconds=per, mode=self.mode,
                                 stale_unloaded={u: s for u, s in stale.items() if s})

    async def _clear_stale(self, c: EngineClient, keep: str) -> list[str]:
        """Unload ``policy@v*`` adapters an engine attached by URL still holds from an earlier run (a
        resumed trainer restarts its versions: a stale adapter under the same name would be served)."""
        old = [n for n in await c.lora_adapters() if re.fullmatch(rf"{NAME_PREFIX}@v\d+", n) and n != keep]
        for n in sorted(old, key=adapter_version):
            await c.unload_lora_adapter(n)
        if keep in await c.lora_adapters():  # same name, content of an earlier run: replace it
            await c.unload_lora_adapter(keep)
            old.append(keep)
        return old


def random_adapter(hf_config, *, targets: tuple[str, ...], r: int, alpha: float, seed: int = 0,
                   scale: float = 0.1) -> tuple[dict[str, torch.Tensor], dict]:
    """A PEFT adapter of random A and B (both nonzero, so it changes the model) for a Qwen3-MoE style
    ``hf_config`` (a transformers config or its dict): tests and benchmarks of the engine side, before
    the trainer has produced one. MLP targets are per expert (``mlp.experts.E.gate_proj`` ...)."""
    c = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
    h, nq, nkv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or h // nq
    inter = c.get("moe_intermediate_size") or c["intermediate_size"]
    experts = c.get("num_experts") or c.get("num_local_experts") or 0  # transformers 5 writes the latter
    shapes = {"q_proj": (nq * hd, h), "k_proj": (nkv * hd, h), "v_proj": (nkv * hd, h), "o_proj": (h, nq * hd),
              "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for layer in range(c["num_hidden_layers"]):
        for t in targets:
            mods = [f"model.layers.{layer}.self_attn.{t}"] if t in ("q_proj", "k_proj", "v_proj", "o_proj") \
                else [f"model.layers.{layer}.mlp.experts.{e}.{t}" for e in range(experts)]
            o, i = shapes[t]
            for m in mods:
                out[f"base_model.model.{m}.lora_A.weight"] = torch.randn(r, i, generator=g) * scale
                out[f"base_model.model.{m}.lora_B.weight"] = torch.randn(o, r, generator=g) * scale
    config = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets),
              "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM", "use_rslora": False, "use_dora": False}
    return out, config


class AdapterChannel(WeightChannel):
    """The train loop's weight-update channel in a LoRA run (``WeightChannel``): each policy version reaches the
    engines as an adapter (``AdapterSync``), never as full weights, so there is no weight-update group and
    nothing is paused, flushed or re-stamped.

    Collective like ``FullWeightChannel.sync``: every rank joins the export (``Policy.export_lora`` gathers the
    TP/EP shards), rank 0 pushes and switches the rollout side (``on_loaded(name, version)``:
    ``rollout.set_adapter``), and every rank learns the outcome -- the adapter name and the engines
    dropped -- or stops with rank 0's error."""

    pauses_engines = False
    """Versions live side by side on an engine, each request on the one it started with: no drain."""

    def __init__(self, policy, layout, engines: list[EngineEndpoint], *, spec: LoraEngineSpec,
                 timeout_s: float, probe_timeout_s: float = 15.0, export_dir: str | None = None,
                 dtype: torch.dtype | None = None, on_loaded=None):
        """``export_dir``: the disk transport's directory (adapters loaded by path); ``dtype``: the engines'
        (the export is cast to it); ``on_loaded``: rank 0's switch of the rollout side to a loaded version."""
        super().__init__(layout, engines, probe_timeout_s=probe_timeout_s)
        self.policy, self.dtype, self.on_loaded = policy, dtype, on_loaded
        self.adapter: str | None = None
        """The adapter the engines serve the trainer's weights under; None = the base model (version 0)."""
        self._joining: list[EngineEndpoint] = []
        self._pusher = AdapterSync([e.url for e in engines], spec=spec, timeout_s=timeout_s,
                                   export_dir=export_dir) if layout.world_rank == 0 else None

    def connect(self) -> None:
        """Nothing to set up: each push is HTTP calls of its own."""

    def close(self) -> None:
        """Nothing to tear down (the engines unload retired versions through the rollout side's router)."""

    def add(self, new: list[EngineEndpoint]) -> None:
        """Engines that join (restarted ones) get the adapter of the next ``sync`` before any request."""
        self._joining += list(new)

    def sync(self, version: str) -> SyncReport:
        t0 = time.perf_counter()
        check_finite_weights(self.policy.module, f"adapter sync v{version}")
        exported = self.policy.export_lora(dst=0, dtype=self.dtype)
        outcome: dict | str | None = None
        if self._pusher is not None:
            try:
                outcome = self._push(*exported, int(version))
            except Exception as e:
                broadcast_object(f"{type(e).__name__}: {e}", what=f"the outcome of adapter sync v{version}")
                raise
        outcome = broadcast_object(outcome, what=f"the outcome of adapter sync v{version}")
        if isinstance(outcome, str):
            raise RuntimeError(f"adapter sync v{version} failed on rank 0: {outcome}")
        dead = outcome["dead"]
        self.engines = self.engines + self._joining
        self.forget_dead(dead)
        self._joining, self.adapter = [], outcome["name"]
        return SyncReport(version=version, transport=f"lora-{outcome['mode']}", seconds=time.perf_counter() - t0,
                          push_seconds=outcome["seconds"], bytes_sent=outcome["bytes"], bytes_in_place=None,
                          dropped_engines=list(dead), dead_reasons=dead)

    def _push(self, tensors: dict[str, torch.Tensor], config: dict, version: int) -> dict:
        """Rank 0: the version into every engine, then into the joining ones (whose current adapter it now
        is), dropping engines found dead on the way; then the rollout side names it in new requests."""
        dead: dict[str, str] = {}
        report = self._without_dead(lambda: self._pusher.push(tensors, config, version), dead)
        joining = [e.url for e in self._joining]
        if joining:
            self._without_dead(lambda: self._pusher.add_engines([u for u in joining if u not in dead]), dead)
        if self.on_loaded is not None:
            self.on_loaded(report.name, version)
        return {"name": report.name, "mode": report.mode, "seconds": report.seconds,
                "bytes": report.tensor_bytes, "dead": dead}

    def _without_dead(self, call, dead: dict[str, str]):
        """``call()``; when engines fail it, those that fail a liveness probe too are dropped (their
        replacements join at a later sync) and it runs once more for the others. An engine that answers
        the probe but refused the adapter stops the run: it would serve another policy than the trainer's."""
        try:
            return call()
        except AdapterSyncError as e:
            gone = self.judge(e.failed)
            if set(e.failed) - set(gone) or not set(self._pusher.urls) - set(gone):
                raise
            self.say_dropped(gone, f"adapter sync {e.name}")
            self._pusher.remove_engines(list(gone))
            dead |= gone
            return call()
