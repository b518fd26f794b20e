"""Fault-injecting fake SGLang 0.5.10 server, for tests only (the main path always uses real SGLang).

Reply shapes are the recorded ones (tests/fixtures/sglang-0.5.10); generation is deterministic in the
prefix (so an aborted-then-resumed sample equals an uninterrupted one), one token per tick (so aborts
and pauses have something to interrupt). Faults:

- ``crash_after``: the n-th /generate emits some tokens, then the connection drops and the server is
  dead (every later request is dropped too), like a SIGKILLed engine;
- ``hang``: /generate never answers (the client must time out); ``hang_endpoints``: these never answer
  (``"*"``: none answers);
- ``unavailable_endpoints``: these answer 503 (``"*"``: every one, like a proxy in front of a dead server);
- run as a process (``python -m tests.fakes.fake_sglang``, it prints its URL) and SIGSTOP it: the port
  still accepts connections and nothing answers, like a stopped SGLang server;
- ``http_400`` / ``http_503``: /generate answers with that status and the recorded error body;
- ``malformed``: /generate answers 200 with a body whose logprobs are null (NaN) or keys missing;
- ``partial_update``: /update_weights_from_distributed answers the recorded "partially updated" 400.

With ``api_key``/``admin_api_key`` it checks ``Authorization: Bearer`` by SGLang 0.5.10's own decision
function (``sglang/srt/utils/auth.py``, loaded from its file so that no torch import is needed).
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
import os
import sys
import threading
import uuid
from dataclasses import dataclass, field

import numpy as np
from aiohttp import web

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "sglang-0.5.10")


def _load_sglang_auth():
    path = os.path.join(importlib.util.find_spec("sglang").submodule_search_locations[0], "srt", "utils", "auth.py")
    spec = importlib.util.spec_from_file_location("_sglang_auth", path)
    mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look the module up
    spec.loader.exec_module(mod)
    return mod


sglang_auth = _load_sglang_auth()
# The endpoints of 0.5.10 marked @auth_level(ADMIN_OPTIONAL) among those mrl calls (every other is NORMAL).
ADMIN_ENDPOINTS = frozenset({
    "/abort_request", "/pause_generation", "/continue_generation", "/flush_cache", "/init_weights_update_group",
    "/destroy_weights_update_group", "/update_weights_from_distributed", "/update_weights_from_tensor",
    "/update_weights_from_disk", "/update_weight_version", "/release_memory_occupation",
    "/resume_memory_occupation", "/get_weights_by_name"})


def fixture(name: str):
    with open(os.path.join(FIXTURES, name)) as f:
        return json.load(f)


@dataclass
class Faults:
    crash_after: int | None = None  # crash during the n-th /generate (1-based)
    crash_after_tokens: int = 2
    hang: bool = False
    hang_endpoints: tuple[str, ...] = ()  # any endpoint: accepted, never answered ("*": all)
    unavailable_endpoints: tuple[str, ...] = ()  # any endpoint: 503 ("*": all)
    http_400: bool = False
    http_503: bool = False
    malformed: str | None = None  # "null_logprob" | "no_meta" | "not_json"
    partial_update: bool = False


@dataclass
class FakeState:
    vocab: int = 512
    num_layers: int = 3
    top_k: int = 2
    num_experts: int = 8
    dense_layers: tuple[int, ...] = ()
    tick_s: float = 0.002
    weight_version: str = "0"
    paused: str | None = None
    dead: bool = False
    generate_calls: int = 0
    groups: set[str] = field(default_factory=set)
    received: list[dict] = field(default_factory=list)


def next_token(ids: list[int], vocab: int) -> int:
    return (ids[-1] * 31 + (ids[-2] if len(ids) > 1 else 0) * 17 + len(ids) * 7 + 3) % vocab


def token_logprob(tok: int) -> float:
    return -1.0 - (tok % 7) / 10.0


def routes_b64(ids: list[int], st: FakeState, start: int = 0) -> str:
    t = np.arange(len(ids))[:, None, None]
    lay = np.arange(st.num_layers)[None, :, None]
    k = np.arange(st.top_k)[None, None, :]
    tok = np.asarray(ids)[:, None, None]
    r = ((tok * 5 + t * 7 + lay * 3 + k) % st.num_experts).astype("<i4")
    for d in st.dense_layers:
        r[:, d, :] = 0
    return base64.b64encode(r[start:].tobytes()).decode()


class FakeSGLang:
    """Run in a background thread: ``with FakeSGLang(faults=Faults(hang=True)) as srv: srv.url``."""

    def __init__(self, faults: Faults | None = None, state: FakeState | None = None, port: int = 0, *,
                 api_key: str | None = None, admin_api_key: str | None = None):
        self.faults = faults or Faults()
        self.api_key, self.admin_api_key = api_key, admin_api_key
        self.refused: list[str] = []  # endpoints of refused requests, in order
        self.st = state or FakeState()
        self._port = port
        self._loop = asyncio.new_event_loop()
        self._inflight: dict[str, asyncio.Event] = {}
        self._resume = None  # asyncio.Event, set when not paused
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    # -- lifecycle -------------------------------------------------------------------------------
    def __enter__(self) -> "FakeSGLang":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._closing.set)
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def _start(self) -> None:
        self._resume = asyncio.Event()
        self._resume.set()
        self._closing = asyncio.Event()
        app = web.Application(middlewares=[self._auth, self._hang])
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_post("/abort_request", self.abort)
        r.add_post("/pause_generation", self.pause)
        r.add_post("/continue_generation", self.cont)
        r.add_route("*", "/flush_cache", self.flush)
        r.add_post("/init_weights_update_group", self.init_group)
        r.add_post("/destroy_weights_update_group", self.destroy_group)
        r.add_post("/update_weights_from_distributed", self.update_distributed)
        r.add_post("/update_weight_version", self.update_version)
        r.add_get("/model_info", self.model_info)
        r.add_get("/server_info", self.server_info)
        r.add_get("/get_weight_version", self.get_weight_version)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health)
        r.add_get("/v1/loads", self.loads)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self._port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        levels = sglang_auth.AuthLevel
        level = levels.ADMIN_OPTIONAL if request.path in ADMIN_ENDPOINTS else levels.NORMAL
        d = sglang_auth.decide_request_auth(method=request.method, path=request.path,
                                            authorization_header=request.headers.get("Authorization"),
                                            api_key=self.api_key, admin_api_key=self.admin_api_key, auth_level=level)
        if not d.allowed:
            self.refused.append(request.path)
            return web.json_response({"error": "Unauthorized" if d.error_status_code == 401 else "Forbidden"},
                                     status=d.error_status_code)
        return await handler(request)

    @web.middleware
    async def _hang(self, request: web.Request, handler):
        f = self.faults
        if request.path in f.hang_endpoints or "*" in f.hang_endpoints:  # never answers (until shut down)
            await self._closing.wait()
            self._drop(request)
        if request.path in f.unavailable_endpoints or "*" in f.unavailable_endpoints:
            return web.json_response({"error": {"message": "Service Unavailable"}}, status=503)
        return await handler(request)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _drop(self, request: web.Request) -> web.Response:
        self.st.dead = True
        request.transport.abort()  # connection reset, no response: like a SIGKILLed server
        raise asyncio.CancelledError()

    # -- generation ------------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        if self.st.dead:
            self._drop(request)
        body = await request.json()
        self.st.generate_calls += 1
        f = self.faults
        if f.http_503:
            return web.json_response({"error": {"message": "Service Unavailable"}}, status=503)
        if f.http_400:
            b = fixture("gen_bad_top_p.json")
            return web.json_response(b["body"], status=b["status"])
        if f.hang:  # never answers (until the test server shuts down)
            await self._closing.wait()
            self._drop(request)
        if "text" in body:
            b = fixture("gen_text_no_tokenizer.json")
            return web.json_response(b["body"], status=400)
        rid = body.get("rid") or uuid.uuid4().hex
        if rid in self._inflight:
            return web.json_response({"error": {"message": f"Duplicate request IDs detected: {rid}"}}, status=400)
        await self._resume.wait()  # new requests block while paused
        sp = body.get("sampling_params", {})
        max_new = int(sp.get("max_new_tokens", 128))
        stops = set(sp.get("stop_token_ids") or [])
        prompt = list(body["input_ids"])
        ids, out = list(prompt), []
        abort = self._inflight[rid] = asyncio.Event()
        crash_now = f.crash_after is not None and self.st.generate_calls >= f.crash_after
        finish = {"type": "length", "length": max_new}
        try:
            while len(out) < max_new:
                if abort.is_set():
                    finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
                    break
                if crash_now and len(out) >= f.crash_after_tokens:
                    self._drop(request)
                await asyncio.sleep(self.st.tick_s)
                tok = next_token(ids, self.st.vocab)
                ids.append(tok)
                out.append(tok)
                if tok in stops:
                    finish = {"type": "stop", "matched": tok}
                    break
        finally:
            self._inflight.pop(rid, None)
        meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(prompt),
                "weight_version": self.st.weight_version, "total_retractions": 0, "input_token_logprobs": [],
                "output_token_logprobs": [[token_logprob(t), t, None] for t in out],
                "output_token_logprobs_length": len(out), "reasoning_tokens": 0, "completion_tokens": len(out),
                "cached_tokens": 0, "cached_tokens_details": None, "dp_rank": None, "e2e_latency": 0.01}
        if body.get("return_routed_experts"):
            start = int(body.get("routed_experts_start_len", 0))  # SGLang 0.5.14: rows from there on
            meta["routed_experts"] = routes_b64(ids[:-1] if out else ids, self.st, start)
        if f.malformed == "null_logprob" and out:
            meta["output_token_logprobs"][0][0] = None
        elif f.malformed == "no_meta":
            return web.json_response({"output_ids": out})
        elif f.malformed == "not_json":
            return web.Response(text="<html>502 Bad Gateway</html>", content_type="text/html")
        return web.json_response({"output_ids": out, "meta_info": meta})

    async def abort(self, request: web.Request) -> web.Response:
        body = await request.json()
        for rid, ev in list(self._inflight.items()):
            if body.get("abort_all") or rid == body.get("rid"):
                ev.set()
        return web.Response(text="")

    async def pause(self, request: web.Request) -> web.Response:
        mode = (await request.json()).get("mode", "abort")
        self.st.paused = mode
        self._resume.clear()
        if mode == "abort":  # returns only after every in-flight request has returned its partial
            for ev in self._inflight.values():
                ev.set()
            while self._inflight:
                await asyncio.sleep(0.001)
        return web.json_response(fixture("pause_abort.json")["body"])

    async def cont(self, request: web.Request) -> web.Response:
        self.st.paused = None
        self._resume.set()
        return web.json_response(fixture("continue_after_abort.json")["body"])

    async def flush(self, request: web.Request) -> web.Response:
        if self._inflight or self.st.paused in ("retract", "in_place"):
            return web.Response(text=fixture("flush_while_paused_retract.json")["body"], status=400)
        return web.Response(text=fixture("flush_idle.json")["body"])

    # -- weights ---------------------------------------------------------------------------------
    async def init_group(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body["group_name"] in self.st.groups:
            return web.json_response({"success": False, "message": "The specified group name has already been created"},
                                     status=400)
        self.st.groups.add(body["group_name"])
        return web.json_response(fixture("init_weights_update_group.json")["body"])

    async def destroy_group(self, request: web.Request) -> web.Response:
        name = (await request.json())["group_name"]
        if name not in self.st.groups:
            b = fixture("destroy_group_missing.json")
            return web.json_response(b["body"], status=400)
        self.st.groups.discard(name)
        return web.json_response(fixture("destroy_weights_update_group.json")["body"])

    async def update_distributed(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body["group_name"] not in self.st.groups:  # what 0.5.10 does: the scheduler dies
            self._drop(request)
        self.st.received.append(body)
        if self.faults.partial_update:
            b = fixture("update_from_distributed_bad_shape.json")
            return web.json_response(b["body"], status=400)
        msg = "Succeeded to update parameter online."
        if body.get("weight_version") is not None:
            self.st.weight_version = body["weight_version"]
            msg += f" Weight version updated to {body['weight_version']}."
        return web.json_response({"success": True, "message": msg})

    async def update_version(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("abort_all_requests", True):
            for ev in self._inflight.values():
                ev.set()
        self.st.weight_version = body["new_version"]
        return web.json_response({"success": True, "message": f"Weight version updated to {body['new_version']}",
                                  "new_version": body["new_version"]})

    # -- info ------------------------------------------------------------------------------------
    async def model_info(self, request: web.Request) -> web.Response:
        if self.st.dead:
            self._drop(request)
        body = dict(fixture("model_info.json")["body"], weight_version=self.st.weight_version)
        return web.json_response(body)

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "0.5.10", "tp_size": 1, "max_total_num_tokens": 4096})

    async def get_weight_version(self, request: web.Request) -> web.Response:
        b = fixture("get_weight_version_404.json")
        return web.json_response(b["body"], status=404)

    async def loads(self, request: web.Request) -> web.Response:
        n = len(self._inflight)
        return web.json_response({"loads": [{"num_running_reqs": n, "num_waiting_reqs": 0, "num_total_reqs": n}]})

    async def health(self, request: web.Request) -> web.Response:
        if self.st.dead:
            self._drop(request)
        await self._resume.wait()
        return web.Response(text="")


def main(argv: list[str] | None = None) -> None:
    """Serve until killed, printing the URL first (tests SIGSTOP the process: a hung server)."""
    import argparse
    import time

    ap = argparse.ArgumentParser()
    ap.add_argument("--tick-s", type=float, default=0.002)
    a = ap.parse_args(argv)
    with FakeSGLang(state=FakeState(tick_s=a.tick_s)) as srv:
        print(srv.url, flush=True)
        while True:
            time.sleep(3600)


if __name__ == "__main__":
    main()
