"""Async HTTP client for one SGLang server (0.5.14; 0.5.10 replies parse too): every endpoint the RL loop
needs, with timeouts.

    client = EngineClient("http://127.0.0.1:30000")
    out = await client.generate([1, 17, 42], {"max_new_tokens": 8, "temperature": 0.0}, rid="s0")
    await client.pause("abort"); await client.flush_cache(); ...; await client.resume()

Guards make the calls that kill or wedge a server impossible to issue (found on 0.5.10, and kept):
an update on a weight-update group this client did not create, ``flush_cache: true`` (or a flush)
after a retract/in-place pause, ``update_weights_from_tensor`` on CPU, health checks while paused.

Every call authenticates (``Authorization: Bearer``): the admin key for weight updates and flow control,
the api key for the rest (SGLang accepts only that one there, mrl.sglang.keys). Without
explicit keys the client takes the run's from ``$MRL_ENGINE_KEYS_FILE``.
"""

from __future__ import annotations

import asyncio
import json as jsonlib
from dataclasses import dataclass
from typing import Any

import aiohttp

from mrl.sglang.endpoint import EngineEndpoint
from mrl.sglang.wire import BATCHED_BUCKETS_MARK, KEEPS_LAYOUTS_MARK
from mrl.sglang.protocol import (
    EngineError,
    EngineGuardError,
    EngineHTTPError,
    EngineHung,
    EngineProtocolError,
    EngineUnavailable,
    GenerateOutput,
    error_message,
    parse_generate,
    parse_lora_update,
    parse_model_info,
    parse_status_ok,
    parse_success,
)
from mrl.sglang.keys import ENV_VAR, EngineSecrets

PAUSE_MODES = ("abort", "retract", "in_place")
KEEPALIVE_S = 2.0


def _without_keys(v: Any) -> Any:
    """0.5.10's /server_info holds its server args, keys included (top level and per DP in
    ``internal_states``): keep them out of anything that logs or stores the reply."""
    if isinstance(v, dict):
        return {k: _without_keys(x) for k, x in v.items() if k not in ("api_key", "admin_api_key")}
    if isinstance(v, list):
        return [_without_keys(x) for x in v]
    return v


async def close_clients(clients: list["EngineClient"]) -> None:
    """Close the connections of ``clients`` made from the running loop (errors ignored: shutting down)."""
    await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)


@dataclass(kw_only=True)
class ClientTimeouts:
    """Seconds; ``None`` = no limit. Generation may legitimately block while the engine is paused."""

    connect: float = 10.0
    control: float = 60.0
    generate: float | None = 3600.0
    weight_update: float = 900.0


class EngineClient:
    def __init__(self, url: str | EngineEndpoint, *, timeouts: ClientTimeouts | None = None, api_key: str | None = None,
                 admin_key: str | None = None, max_connections: int = 256, routes_always: bool = False):
        """``routes_always``: ask for routed experts on every /generate. SGLang 0.5.10's tokenizer manager
        dies (IndexError in ``_handle_batch_output``) when one output batch mixes requests with and without
        ``return_routed_experts``; a client that shares an engine with rollouts must never mix them."""
        self.url = (url.url if isinstance(url, EngineEndpoint) else url).rstrip("/")
        self.routes_always = routes_always
        self.timeouts = timeouts or ClientTimeouts()
        if api_key is None and admin_key is None and (run := EngineSecrets.from_env()) is not None:
            api_key, admin_key = run.api_key, run.admin_api_key
        self._keys = (api_key, admin_key or api_key)
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}  # one per event loop
        self._max_connections = max_connections
        self.groups: set[str] = set()  # weight-update groups this client created
        # of those, the ones whose engine takes every bucket of a sync in one request (patches.BATCHED_BUCKETS_FORMAT)
        self.batched_groups: set[str] = set()
        self.keeps_layouts = False  # the engine keeps a batched request's tensor lists (patches.KEEPS_LAYOUTS_MARK)
        self.kept_layouts: set[str] = set()  # the keys it answered as kept
        self.paused: str | None = None  # pause mode in force, if any

    # -- transport -------------------------------------------------------------------------------
    def _session(self) -> aiohttp.ClientSession:
        """aiohttp, not httpx: with tens of requests in flight, httpcore's pool re-checks every connection
        on every request (``has_expired`` via anyio's ``get_extra_info``); in overlap mode that was 70% of
        the rollout process's time (py-spy), against a few percent for aiohttp's connector."""
        loop = asyncio.get_running_loop()
        for old in [x for x in self._sessions if x.is_closed()]:  # sessions of finished loops (tests)
            self._sessions.pop(old)
        s = self._sessions.get(loop)
        if s is None or s.closed:
            # idle connections are dropped well before SGLang's server closes them (uvicorn keep-alive,
            # $SGLANG_TIMEOUT_KEEP_ALIVE = 5 s): a request on a connection the server just closed would fail
            s = self._sessions[loop] = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._max_connections, keepalive_timeout=KEEPALIVE_S),
                json_serialize=jsonlib.dumps)
        return s

    async def close(self) -> None:
        s = self._sessions.pop(asyncio.get_running_loop(), None)
        if s is not None:
            await s.close()

    def auth_headers(self, *, admin: bool = False) -> dict[str, str] | None:
        """The ``Authorization`` header for generation (api key) or admin endpoints (weight updates,
        flow control); None when the engine runs without keys. Also used by the pipelined bucket posts."""
        key = self._keys[1] if admin else self._keys[0]
        return {"Authorization": f"Bearer {key}"} if key else None

    async def _call(self, method: str, endpoint: str, *, json: Any = None, timeout: float | None,
                    admin: bool = False, ok: tuple[int, ...] = (200,)) -> tuple[int, Any, str]:
        headers = self.auth_headers(admin=admin)
        t = aiohttp.ClientTimeout(total=timeout, connect=self.timeouts.connect)
        try:
            async with self._session().request(method, self.url + endpoint, json=json, headers=headers,
                                               timeout=t) as r:
                status, raw = r.status, await r.read()
        except aiohttp.ConnectionTimeoutError as e:
            raise EngineUnavailable(self.url, endpoint, f"no connection within {self.timeouts.connect}s") from e
        except asyncio.TimeoutError as e:  # the whole call's limit (aiohttp's ServerTimeoutError is one too)
            raise EngineUnavailable(self.url, endpoint, f"timed out after {timeout}s (no answer)") from e
        except aiohttp.ClientError as e:  # refused, reset, disconnected, malformed HTTP
            raise EngineUnavailable(self.url, endpoint, f"connection failed: {type(e).__name__}: {e}") from e
        text = raw.decode("utf-8", "replace")
        body: Any = None
        if text:
            try:
                body = jsonlib.loads(text)
            except ValueError:
                body = None
        if status not in ok:
            if status in (401, 403):
                raise EngineHTTPError(self.url, endpoint, status, "the engine refused this client's "
                                      f"{'admin' if admin else 'api'} key (is ${ENV_VAR} the run's keys file?)")
            if status in (502, 503, 504):
                raise EngineUnavailable(self.url, endpoint, f"HTTP {status}: {error_message(body, text)}", status)
            raise EngineHTTPError(self.url, endpoint, status, error_message(body, text))
        return status, body, text

    # -- generation ------------------------------------------------------------------------------
    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], *, rid: str,
                       return_logprob: bool = True, return_routed_experts: bool = False,
                       top_logprobs_num: int = 0, logprob_start_len: int | None = None,
                       routed_experts_start_len: int | None = None, lora_path: str | None = None,
                       token_ids_logprob: list[int] | None = None) -> GenerateOutput:
        """One sample (one rid: abortable, own logprobs and routes). ``n > 1`` is refused: SGLang
        replaces the rid of each of the n samples with a fresh uuid, so they could not be aborted.
        ``routed_experts_start_len``: the routes reply starts at that row (SGLang 0.5.14; rows before it
        are the caller's already), so a continued conversation does not fetch its whole history again.
        ``lora_path``: the registered NAME of a loaded adapter (SGLang's field name notwithstanding).
        ``token_ids_logprob``: the logprobs of these ids at every input position from ``logprob_start_len`` on
        and at every output position (``GenerateOutput.input_token_ids_logprobs``, ``output_...``)."""
        if not input_ids:
            raise ValueError("generate: input_ids is empty")
        if routed_experts_start_len is not None and not 0 <= routed_experts_start_len <= len(input_ids):
            # SGLang answers an out-of-range start with an aborted request, not an error: refuse it here
            raise ValueError(f"generate: routed_experts_start_len={routed_experts_start_len} is outside "
                             f"[0, {len(input_ids)}] (the input's length)")
        if sampling_params.get("n", 1) != 1:
            raise ValueError("generate: send one request per sample (sampling_params.n must be 1)")
        body = {"input_ids": list(input_ids), "sampling_params": sampling_params, "rid": rid,
                "return_logprob": return_logprob}
        if return_routed_experts or self.routes_always:
            body["return_routed_experts"] = True
            if routed_experts_start_len:
                body["routed_experts_start_len"] = routed_experts_start_len
        if top_logprobs_num:
            body["top_logprobs_num"] = top_logprobs_num
        if logprob_start_len is not None:  # 0: also the logprobs of every prompt token (first is null)
            body["logprob_start_len"] = logprob_start_len
        if lora_path is not None:
            body["lora_path"] = lora_path
        if token_ids_logprob:
            body["token_ids_logprob"] = list(token_ids_logprob)
        _, data, _ = await self._call("POST", "/generate", json=body, timeout=self.timeouts.generate)
        out = parse_generate(data, (self.url, "/generate"), expect_logprobs=return_logprob)
        if isinstance(out, list):
            raise EngineProtocolError(self.url, "/generate", "expected one result for one request, got a list")
        if out.rid != rid:
            raise EngineProtocolError(self.url, "/generate", f"reply for rid {out.rid!r}, asked {rid!r}")
        return out

    async def classify(self, input_ids: list[int], *, rid: str) -> list[float]:
        """The scores of a classification or reward model server (``--is-embedding``; SGLang's ``/classify``) for
        one sequence: one value per label, taken at its last token."""
        if not input_ids:
            raise ValueError("classify: input_ids is empty")
        body = {"input_ids": list(input_ids), "rid": rid}
        _, data, _ = await self._call("POST", "/classify", json=body, timeout=self.timeouts.generate)
        if isinstance(data, list) and len(data) == 1:
            data = data[0]
        scores = data.get("embedding") if isinstance(data, dict) else None
        if not isinstance(scores, list) or not scores or not all(isinstance(x, (int, float)) for x in scores):
            raise EngineProtocolError(self.url, "/classify", f"no 'embedding' list of scores: {data!r:.160}")
        return [float(x) for x in scores]

    async def abort(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        """Abort one request (by rid) or all; the aborted /generate returns its partial output."""
        if (rid is None) == (not abort_all):
            raise ValueError("abort: give exactly one of rid or abort_all=True")
        body = {"abort_all": True} if abort_all else {"rid": rid}
        await self._call("POST", "/abort_request", json=body, timeout=self.timeouts.control, admin=True)

    # -- flow control ----------------------------------------------------------------------------
    async def pause(self, mode: str = "abort") -> None:
        """abort: returns after every in-flight request has returned its partial (abort). retract/in_place:
        requests stay open and continue after ``resume``; flushing is then impossible in 0.5.10."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause: mode must be one of {PAUSE_MODES}, got {mode!r}")
        _, body, _ = await self._call("POST", "/pause_generation", json={"mode": mode},
                                      timeout=self.timeouts.control, admin=True)
        parse_status_ok(body, (self.url, "/pause_generation"))
        self.paused = mode

    async def resume(self) -> None:
        _, body, _ = await self._call("POST", "/continue_generation", json={}, timeout=self.timeouts.control,
                                      admin=True)
        parse_status_ok(body, (self.url, "/continue_generation"))
        self.paused = None

    async def flush_cache(self, *, retries: int = 600, interval: float = 0.1) -> None:
        """Flush the radix/KV cache; retried while requests are still draining (400 'Flush cache failed').
        Aborted requests drain within tens of ms: a short interval keeps a weight sync's pause short."""
        if self.paused in ("retract", "in_place"):
            raise EngineGuardError(self.url, "/flush_cache", f"cannot flush while paused in {self.paused!r} mode "
                                   "(0.5.10 keeps those requests queued; pause with mode='abort' first)")
        for attempt in range(retries):
            try:
                await self._call("POST", "/flush_cache", timeout=self.timeouts.control, admin=True)
                return
            except EngineHTTPError as e:
                if e.status != 400 or attempt == retries - 1:
                    raise
                await asyncio.sleep(interval)

    # -- weights ---------------------------------------------------------------------------------
    async def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str) -> None:
        """Blocks until the trainer joins the rendezvous: run it concurrently with the trainer side."""
        if group_name in self.groups:
            raise EngineGuardError(self.url, "/init_weights_update_group", f"group {group_name!r} already exists")
        body = dict(master_address=master_address, master_port=master_port, rank_offset=rank_offset,
                    world_size=world_size, group_name=group_name, backend=backend)
        _, data, _ = await self._call("POST", "/init_weights_update_group", json=body,
                                      timeout=self.timeouts.weight_update, admin=True, ok=(200, 400))
        message = parse_success(data, (self.url, "/init_weights_update_group"))
        self.groups.add(group_name)
        if BATCHED_BUCKETS_MARK in message:
            self.batched_groups.add(group_name)
            self.keeps_layouts = KEEPS_LAYOUTS_MARK in message

    async def destroy_weights_update_group(self, group_name: str) -> None:
        _, data, _ = await self._call("POST", "/destroy_weights_update_group", json={"group_name": group_name},
                                      timeout=self.timeouts.control, admin=True, ok=(200, 400))
        self.groups.discard(group_name)
        self.batched_groups.discard(group_name)
        parse_success(data, (self.url, "/destroy_weights_update_group"))

    async def update_weights_from_distributed(self, *, names: list[str], dtypes: list[str],
                                              shapes: list[list[int]], group_name: str,
                                              weight_version: str | None = None, flush_cache: bool = False,
                                              load_format: str | None = None) -> str:
        """Returns after the engine received the broadcasts: post it while the trainer broadcasts."""
        ep = "/update_weights_from_distributed"
        if group_name not in self.groups:  # an unknown group kills the 0.5.10 scheduler
            raise EngineGuardError(self.url, ep, f"group {group_name!r} was not created by this client")
        if flush_cache and self.paused in ("retract", "in_place"):  # trips an assert in 0.5.10
            raise EngineGuardError(self.url, ep, f"flush_cache=True while paused in {self.paused!r} mode")
        if not (len(names) == len(dtypes) == len(shapes)) or not names:
            raise ValueError(f"{ep}: names/dtypes/shapes must be non-empty and of equal length")
        if any(d.startswith("torch.") for d in dtypes):
            raise ValueError(f"{ep}: dtypes are torch attribute names without 'torch.' (e.g. 'bfloat16')")
        body = dict(names=names, dtypes=dtypes, shapes=shapes, group_name=group_name, flush_cache=flush_cache,
                    weight_version=weight_version, load_format=load_format)
        _, data, _ = await self._call("POST", ep, json=body, timeout=self.timeouts.weight_update, admin=True,
                                      ok=(200, 400))
        return parse_success(data, (self.url, ep))

    async def update_weights_from_tensor(self, serialized_named_tensors: list[str], *, load_format: str | None = None,
                                         flush_cache: bool = False, weight_version: str | None = None) -> str:
        """Colocated engines only: element i (consumed by engine TP rank i) carries CUDA IPC handles
        (``mrl.weight_sync.transport.serialize_named_tensors``). CPU tensors crash a 0.5.10 server,
        so payloads are built only from CUDA tensors (the tensor transport refuses otherwise)."""
        ep = "/update_weights_from_tensor"
        if not serialized_named_tensors:
            raise ValueError(f"{ep}: serialized_named_tensors must hold one payload per engine TP rank")
        body = dict(serialized_named_tensors=serialized_named_tensors, load_format=load_format,
                    flush_cache=flush_cache, abort_all_requests=False, weight_version=weight_version)
        _, data, _ = await self._call("POST", ep, json=body, timeout=self.timeouts.weight_update, admin=True,
                                      ok=(200, 400))
        return parse_success(data, (self.url, ep))

    async def update_weights_from_disk(self, model_path: str, *, weight_version: str | None = None,
                                       flush_cache: bool = True, load_format: str | None = None) -> str:
        """``flush_cache``: SGLang's default flushes the cache after the load, which fails an assert in the
        scheduler (and kills it) while requests are held by a retract/in-place pause. ``load_format``: how to
        read ``model_path`` (null: the server's own, the one it started with; an engine started with
        ``load_format=dummy`` has no reader of files until one is named, e.g. ``auto``)."""
        ep = "/update_weights_from_disk"
        if flush_cache and self.paused in ("retract", "in_place"):
            raise EngineGuardError(self.url, ep, f"flush_cache=True while paused in {self.paused!r} mode")
        body = {"model_path": model_path, "weight_version": weight_version, "flush_cache": flush_cache}
        if load_format is not None:
            body["load_format"] = load_format
        _, data, _ = await self._call("POST", ep, json=body, timeout=self.timeouts.weight_update, admin=True,
                                      ok=(200, 400))
        return parse_success(data, (self.url, ep))

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """An engine started with ``engine.memory_saver``, idle: give the GPU memory of ``tags`` back
        (``kv_cache``, ``weights``, ``cuda_graph``; None: all) until ``resume_memory_occupation``. Released
        weights come back as whatever the memory then holds: push them again after resuming."""
        await self._call("POST", "/release_memory_occupation", json={"tags": tags},
                         timeout=self.timeouts.weight_update, admin=True)

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self._call("POST", "/resume_memory_occupation", json={"tags": tags},
                         timeout=self.timeouts.weight_update, admin=True)

    async def update_weight_version(self, new_version: str, *, abort_all_requests: bool = False) -> None:
        """0.5.10's default aborts every request: mrl passes False unless asked."""
        ep = "/update_weight_version"
        _, data, _ = await self._call("POST", ep, json={"new_version": new_version,
                                                        "abort_all_requests": abort_all_requests},
                                      timeout=self.timeouts.control, admin=True, ok=(200, 400))
        parse_success(data, (self.url, ep))

    # -- LoRA adapters ---------------------------------------------------------------------------
    async def load_lora_adapter_from_tensors(self, lora_name: str, config_dict: dict, serialized_tensors: str, *,
                                             timeout: float | None = None) -> list[str]:
        """Register adapter ``lora_name`` from ``serialized_tensors`` (``mrl.weight_sync.adapter.
        serialize_adapter``: base64 of a plain pickle; a ForkingPickler payload of CPU tensors kills the
        server). SGLang guards this endpoint at the normal level, so it takes the api key, not the admin
        key. Returns the adapters the engine holds afterwards; a name already loaded is refused (400)."""
        ep = "/load_lora_adapter_from_tensors"
        body = {"lora_name": lora_name, "config_dict": config_dict, "serialized_tensors": serialized_tensors}
        _, data, _ = await self._call("POST", ep, json=body, ok=(200, 400),
                                      timeout=self.timeouts.weight_update if timeout is None else timeout)
        return parse_lora_update(data, (self.url, ep))

    async def load_lora_adapter(self, lora_name: str, lora_path: str, *, timeout: float | None = None) -> list[str]:
        """Register adapter ``lora_name`` from a PEFT directory the engine can read."""
        ep = "/load_lora_adapter"
        _, data, _ = await self._call("POST", ep, json={"lora_name": lora_name, "lora_path": lora_path},
                                      timeout=self.timeouts.weight_update if timeout is None else timeout,
                                      admin=True, ok=(200, 400))
        return parse_lora_update(data, (self.url, ep))

    async def unload_lora_adapter(self, lora_name: str) -> list[str]:
        """Unregister ``lora_name``. SGLang then waits for every request holding it; one paused in
        retract/in-place mode never ends, so only unload adapters no request of ours uses
        (``mrl.rollout.lora.AdapterRouter``)."""
        ep = "/unload_lora_adapter"
        if self.paused in ("retract", "in_place"):
            raise EngineGuardError(self.url, ep, f"unloading {lora_name!r} while paused in {self.paused!r} mode "
                                   "waits for the paused requests that hold it: a deadlock")
        _, data, _ = await self._call("POST", ep, json={"lora_name": lora_name}, timeout=self.timeouts.control,
                                      admin=True, ok=(200, 400))
        return parse_lora_update(data, (self.url, ep))

    async def lora_adapters(self) -> list[str]:
        """Names of the adapters the engine holds (``/v1/models``: the cards with a parent)."""
        _, data, _ = await self._call("GET", "/v1/models", timeout=self.timeouts.control)
        if not isinstance(data, dict) or not isinstance(data.get("data"), list):
            raise EngineProtocolError(self.url, "/v1/models", f"no 'data' list: {data!r:.160}")
        return sorted(m["id"] for m in data["data"] if isinstance(m, dict) and m.get("parent"))

    # -- introspection ---------------------------------------------------------------------------
    async def model_info(self) -> dict:
        _, data, _ = await self._call("GET", "/model_info", timeout=self.timeouts.control)
        return parse_model_info(data, (self.url, "/model_info"))

    async def weight_version(self) -> str:
        return (await self.model_info())["weight_version"]

    async def server_info(self) -> dict:
        _, data, _ = await self._call("GET", "/server_info", timeout=self.timeouts.control)
        if not isinstance(data, dict) or "version" not in data:
            raise EngineProtocolError(self.url, "/server_info", "no 'version' key")
        return _without_keys(data)

    async def weight_checksums(self) -> list[dict[str, str]]:
        """Per TP rank, the hash of every parameter the engine holds, under its own names and layout
        (``/weights_checker``, action ``checksum``: ``sglang.srt.managers.mm_utils.tensor_hash``)."""
        _, data, _ = await self._call("POST", "/weights_checker", json={"action": "checksum"},
                                      timeout=self.timeouts.control, admin=True)
        if not isinstance(data, dict) or not isinstance(data.get("ranks"), list):
            raise EngineProtocolError(self.url, "/weights_checker", "no 'ranks' list")
        return [r["checksums"] for r in data["ranks"]]

    async def probe(self, timeout: float) -> None:
        """Liveness: ``GET /model_info`` answered within ``timeout`` s. The HTTP server answers it alone (no
        round trip to the scheduler), so a paused or busy engine answers at once, while a stopped or wedged
        one does not (``/health`` generates a token: it blocks while paused). Raises ``EngineUnavailable``
        when refused, not answered, or answered with a 5xx; any other answer, an error status included,
        means the server is up."""
        try:
            await self._call("GET", "/model_info", timeout=timeout)
        except EngineHTTPError as e:
            if e.status >= 500:
                raise EngineUnavailable(self.url, "/model_info", e.detail, e.status) from e

    async def health(self, timeout: float = 20.0) -> bool:
        if self.paused:
            raise EngineGuardError(self.url, "/health", "health checks block while the engine is paused")
        try:
            await self._call("GET", "/health", timeout=timeout)
            return True
        except EngineError:
            return False

    async def loads(self) -> dict:
        _, data, _ = await self._call("GET", "/v1/loads", timeout=self.timeouts.control)
        return data


PROBE_GRACE_S = 1.0
"""How long a control call (pause, flush, abort, stamp) may take before the engine is probed meanwhile:
these answer within milliseconds on a live engine, and a liveness probe costs one cheap GET."""


async def liveness(client: EngineClient, timeout_s: float, *, attempts: int = 3, retry_s: float = 1.0) -> str | None:
    """Why the engine behind ``client`` is dead, or None when it is up. Dead: its port refuses connections
    (killed), or it accepts them but answers no probe (``EngineClient.probe``) within ``timeout_s`` (a
    SIGSTOPped or wedged server: the kernel still accepts connections for it), or it answers a 5xx to
    each of ``attempts`` probes ``retry_s`` apart (a server stuck failing, or a proxy in front of a dead
    one). A refusal or a silence is final at once; a 5xx may be a moment's overload, hence the retries."""
    last = None
    for i in range(attempts):
        try:
            await client.probe(timeout_s)
            return None
        except EngineUnavailable as e:
            if e.status is None:  # refused, reset or silent
                return f"liveness probe failed: {e}"
            last = e
        if i + 1 < attempts:
            await asyncio.sleep(retry_s)
    return f"liveness probe failed {attempts} times, {retry_s:g} s apart: {last}"


async def watched(client: EngineClient, call, endpoint: str, *, probe_timeout_s: float,
                  grace_s: float = PROBE_GRACE_S):
    """Await ``call`` (a coroutine of a request to ``client``'s engine). When it has not returned after
    ``grace_s``, the engine is probed meanwhile (``liveness``); if the probe fails, the call is cancelled
    and ``EngineHung`` raised naming ``endpoint``. So a stopped engine costs about ``grace_s +
    probe_timeout_s``, not the call's own limit (60 s for control calls), while a live engine that is
    merely slow keeps its call running to that limit."""
    task = asyncio.ensure_future(call)
    probe = None
    try:
        done, _ = await asyncio.wait({task}, timeout=grace_s)
        if task in done:
            return task.result()
        probe = asyncio.ensure_future(liveness(client, probe_timeout_s))
        done, _ = await asyncio.wait({task, probe}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        why = probe.result()
        if why is None:  # up, only slow: the call keeps its own limit
            return await task
        raise EngineHung(client.url, endpoint, f"no answer after {grace_s:g} s and {why}")
    finally:
        for t in (task, probe):
            if t is not None and not t.done():
                t.cancel()
