"""Pipelined bucket requests: the servers that receive them (uvicorn/h11 as SGLang runs it, aiohttp as
the benchmark receiver runs) handle one connection's requests strictly one after the other, in order,
and the client reads every answer (content-length or chunked), or fails the rest cleanly."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest

from mrl.sglang.protocol import EngineUnavailable
from mrl.sglang.pipeline import post_pipelined


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Log:
    def __init__(self) -> None:
        self.spans: list[tuple[int, float, float]] = []  # (request i, start, end)

    def sequential_in_order(self) -> bool:
        order = [i for i, _, _ in self.spans]
        no_overlap = all(a[2] <= b[1] for a, b in zip(self.spans, self.spans[1:]))
        return order == sorted(order) and no_overlap


def _asgi_app(log: Log, delay: float, chunked: bool):
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        i = json.loads(body)["i"]
        t0 = time.monotonic()
        await asyncio.sleep(delay if i % 2 else 0)  # uneven work: a concurrent server would reorder
        log.spans.append((i, t0, time.monotonic()))
        out = json.dumps({"success": i != 3, "message": f"bucket {i}"}).encode()
        headers = [(b"content-type", b"application/json")]
        if chunked:  # no content-length: uvicorn answers with Transfer-Encoding: chunked
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": out[:5], "more_body": True})
            await send({"type": "http.response.body", "body": out[5:]})
        else:
            headers.append((b"content-length", str(len(out)).encode()))
            await send({"type": "http.response.start", "status": 400 if i == 3 else 200, "headers": headers})
            await send({"type": "http.response.body", "body": out})

    return app


def _uvicorn(app, port: int):
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http="h11", log_level="warning",
                                           lifespan="off"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    for _ in range(200):
        if server.started:
            return server, t
        time.sleep(0.02)
    raise RuntimeError("uvicorn did not start")


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_uvicorn_h11_takes_pipelined_requests_in_order(chunked):
    log, port = Log(), _free_port()
    server, t = _uvicorn(_asgi_app(log, 0.03, chunked), port)
    try:
        bodies = [json.dumps({"i": i}).encode() for i in range(8)]
        answers = asyncio.run(post_pipelined(f"http://127.0.0.1:{port}", "/update", bodies,
                                             headers={"Authorization": "Bearer k"}, timeout=10))
    finally:
        server.should_exit = True
        t.join(10)
    assert [json.loads(a[1])["message"] for a in answers] == [f"bucket {i}" for i in range(8)]
    assert [a[0] for a in answers] == [200] * 8 if chunked else [200, 200, 200, 400] + [200] * 4
    assert log.sequential_in_order()


def test_aiohttp_takes_pipelined_requests_in_order():
    from aiohttp import web

    log = Log()

    async def handle(req):
        i = (await req.json())["i"]
        t0 = time.monotonic()
        await asyncio.sleep(0.03 if i % 2 else 0)
        log.spans.append((i, t0, time.monotonic()))
        return web.json_response({"success": True, "message": f"bucket {i}"})

    async def go():
        app = web.Application()
        app.router.add_post("/update", handle)
        runner = web.AppRunner(app)
        await runner.setup()
        port = _free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            return await post_pipelined(f"http://127.0.0.1:{port}", "/update",
                                        [json.dumps({"i": i}).encode() for i in range(8)], timeout=10)
        finally:
            await runner.cleanup()

    answers = asyncio.run(go())
    assert [json.loads(a[1])["message"] for a in answers] == [f"bucket {i}" for i in range(8)]
    assert log.sequential_in_order()


def test_refused_connection_fails_every_request():
    answers = asyncio.run(post_pipelined(f"http://127.0.0.1:{_free_port()}", "/update", [b"{}"] * 3, timeout=5))
    assert len(answers) == 3 and all(isinstance(a, EngineUnavailable) for a in answers)


def test_timeout_fails_the_rest():
    log, port = Log(), _free_port()
    server, t = _uvicorn(_asgi_app(log, 2.0, False), port)
    try:
        answers = asyncio.run(post_pipelined(f"http://127.0.0.1:{port}", "/update",
                                             [json.dumps({"i": i}).encode() for i in range(3)], timeout=0.5))
    finally:
        server.should_exit = True
        t.join(10)
    assert answers[0][0] == 200  # request 0 has no delay
    assert "timed out" in str(answers[1]) and "not answered" in str(answers[2])
