"""HTTP/1.1 pipelining of one engine's bucket updates: every request of a sync is written at once on
one connection, the answers are read in order.

Why: an SGLang engine serves one weight request at a time, and request k+1 must reach it after
request k (a bucket received with another bucket's metadata is a size mismatch, a hang or garbage).
Awaiting each answer before posting the next (the safe order) leaves a client round trip between
buckets during which the wire is idle. Servers handle the requests of one connection strictly one
after the other, in arrival order (uvicorn, SGLang's server: the next request is parsed once the
previous answer is complete; aiohttp likewise), so pipelining keeps the order and request k+1 is
already waiting inside the engine when request k finishes.

    answers = await post_pipelined(url, "/update_weights_from_distributed", bodies, headers=h, timeout=900)
    # [(status, body bytes) | EngineUnavailable, ...] in request order
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

from mrl.sglang.protocol import EngineUnavailable


async def _read_answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    status = int(head[0].split(" ", 2)[1])
    headers = {}
    for line in head[1:]:
        if line:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
    if "content-length" in headers:
        return status, await reader.readexactly(int(headers["content-length"]))
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = bytearray()
        while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
            body += await reader.readexactly(size)
            await reader.readexactly(2)
        while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers
            pass
        return status, bytes(body)
    return status, await reader.read()  # delimited by the server closing the connection


async def post_pipelined(url: str, path: str, bodies: list[bytes], *, headers: dict[str, str] | None = None,
                         timeout: float, connect_timeout: float = 10.0) -> list[tuple[int, bytes] | EngineUnavailable]:
    """POST every JSON body to ``url + path`` over one connection; one answer (or error) per body, in
    order. ``timeout`` applies to each answer. A broken connection fails the remaining requests."""
    u = urlsplit(url)
    host, port = u.hostname, u.port or 80
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), connect_timeout)
    except (OSError, asyncio.TimeoutError) as e:
        err = EngineUnavailable(url, path, f"connection failed: {type(e).__name__}: {e}")
        return [err] * len(bodies)
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    head = f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n{extra}"
    payload = b"".join(head.encode("latin-1") + f"Content-Length: {len(b)}\r\n\r\n".encode() + b for b in bodies)

    async def send() -> None:  # in its own task: a server that stops reading must not block our reads
        writer.write(payload)
        await writer.drain()

    sender = asyncio.create_task(send())
    out: list[tuple[int, bytes] | EngineUnavailable] = []
    try:
        for _ in bodies:
            try:
                out.append(await asyncio.wait_for(_read_answer(reader), timeout))
            except asyncio.TimeoutError:
                out.append(EngineUnavailable(url, path, f"timed out after {timeout}s"))
                break
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, IndexError) as e:
                out.append(EngineUnavailable(url, path, f"connection failed: {type(e).__name__}: {e}"))
                break
    finally:
        sender.cancel()
        writer.close()
    if len(out) < len(bodies):
        out += [EngineUnavailable(url, path, f"not answered: {out[-1].detail}")] * (len(bodies) - len(out))
    return out
