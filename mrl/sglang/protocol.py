"""Typed, defensive parsing of SGLang 0.5.14 HTTP responses (0.5.10's, recorded in tests/fixtures/, parse too).

Anything that does not match raises ``EngineProtocolError`` naming the endpoint and the field, so a
malformed reply can never turn into silently wrong training data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mrl.sglang.wire import TOKEN_VERSIONS_KEY


class EngineError(RuntimeError):
    """Base of every engine-side failure; carries the engine URL and endpoint."""

    def __init__(self, url: str, endpoint: str, message: str):
        super().__init__(f"{url}{endpoint}: {message}")
        self.url, self.endpoint, self.detail = url, endpoint, message


class EngineHTTPError(EngineError):
    """The server answered with an error status (400 validation, 503 unavailable, ...)."""

    def __init__(self, url: str, endpoint: str, status: int, message: str):
        super().__init__(url, endpoint, f"HTTP {status}: {message}")
        self.status = status


class EngineProtocolError(EngineError):
    """The reply does not have the shape SGLang gives."""


class EngineUnavailable(EngineError):
    """Connection refused/reset, a timeout, or a 502/503/504: the engine may be dead or hung (retry elsewhere)."""

    def __init__(self, url: str, endpoint: str, message: str, status: int | None = None):
        super().__init__(url, endpoint, message)
        self.status = status
        """The HTTP status when the engine answered one (5xx), else None."""


class EngineHung(EngineUnavailable):
    """The engine did not pass a liveness probe (``mrl.sglang.client.liveness``): it refused, or accepted the
    connection and answered nothing within the probe's limit (a stopped or wedged server: its kernel still
    accepts connections), or answered 5xx to every probe. Its calls are abandoned; the engine is dropped."""


class EngineGuardError(EngineError):
    """Refused locally: the call is known to crash or wedge a 0.5.10 server (never sent)."""


@dataclass(frozen=True)
class FinishReason:
    type: str  # "length" | "stop" | "abort"
    matched: int | str | None = None
    message: str | None = None

    @property
    def aborted(self) -> bool:
        return self.type == "abort"


@dataclass(frozen=True)
class GenerateOutput:
    rid: str
    output_ids: list[int]
    output_logprobs: list[float] | None
    finish: FinishReason | None  # None only in intermediate stream chunks
    weight_version: str
    prompt_tokens: int | None  # absent when aborted in the waiting queue
    completion_tokens: int
    cached_tokens: int | None
    total_retractions: int
    # base64 [prompt + output - 1, layers, top_k] of int32 (uint8/int16 from mrl's engines); mrl.routing.codec
    routed_experts: str | None
    output_top_logprobs: list[list[tuple[float, int]]] | None
    input_logprobs: list[float | None] | None = None  # with logprob_start_len >= 0; first entry None
    input_token_ids_logprobs: list[dict[int, float] | None] | None = None
    """With ``token_ids_logprob``: per input position from ``logprob_start_len`` on, the asked ids' logprobs
    there (None where the engine gives none: the first position)."""
    output_token_ids_logprobs: list[dict[int, float]] | None = None
    """With ``token_ids_logprob``: per output position, the asked ids' logprobs there."""
    token_versions: list[int | str] | None = None
    """Per output token, the version of the weights that produced it (engines with mrl's in-flight patch)."""


def _req(d: dict, key: str, typ, where: str, ctx: tuple[str, str]):
    if key not in d:
        raise EngineProtocolError(*ctx, f"{where}: missing '{key}'")
    v = d[key]
    if not isinstance(v, typ) or isinstance(v, bool) and typ is not bool:
        raise EngineProtocolError(*ctx, f"{where}.{key}: expected {typ}, got {type(v).__name__} {v!r:.80}")
    return v


def _finish(v: Any, ctx) -> FinishReason | None:
    if v is None:
        return None
    if not isinstance(v, dict) or v.get("type") not in ("length", "stop", "abort"):
        raise EngineProtocolError(*ctx, f"meta_info.finish_reason: unexpected {v!r:.120}")
    matched, message = v.get("matched"), v.get("message")
    if isinstance(matched, bool) or not isinstance(matched, (int, str, type(None))) \
            or not isinstance(message, (str, type(None))):
        raise EngineProtocolError(*ctx, f"meta_info.finish_reason: bad matched/message in {v!r:.120}")
    return FinishReason(v["type"], matched, message)


def _count(meta: dict, key: str, ctx, default: int | None = None) -> int | None:
    v = meta.get(key, default)
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
        raise EngineProtocolError(*ctx, f"meta_info.{key}: expected a count, got {v!r:.40}")
    return v


MAX_LOGPROB = 1e-3


def _logprob(t: Any, where: str, ctx, *, nullable: bool = False) -> float | None:
    """The logprob of one ``[logprob, id, text]`` triple (orjson sends NaN/inf as null)."""
    if not isinstance(t, list) or len(t) < 2 or not isinstance(t[1], int) or isinstance(t[1], bool):
        raise EngineProtocolError(*ctx, f"{where}: not a [logprob, id, text] triple: {t!r:.80}")
    lp = t[0]
    if lp is None and nullable:
        return None
    if not isinstance(lp, (int, float)) or isinstance(lp, bool) or not math.isfinite(lp):
        raise EngineProtocolError(*ctx, f"{where}: logprob is {lp!r} (NaN from the engine?)")
    if lp > MAX_LOGPROB:  # a log-probability is <= 0; rounding leaves a few ulps above it, never this much
        raise EngineProtocolError(*ctx, f"{where}: logprob is {lp!r} > 0 (not a log-probability)")
    return float(lp)


def _logprob_triples(v: Any, n: int, where: str, ctx) -> list[float]:
    if not isinstance(v, list) or len(v) != n:
        raise EngineProtocolError(*ctx, f"{where}: expected {n} [logprob, id, text] triples, got {v!r:.120}")
    return [_logprob(t, f"{where}[{i}]", ctx) for i, t in enumerate(v)]


def _top_logprobs(v: Any, where: str, ctx) -> list[list[tuple[float, int]]]:
    """Per position, the top ``[logprob, id, text]`` triples (a position may be null)."""
    if not isinstance(v, list) or not all(step is None or isinstance(step, list) for step in v):
        raise EngineProtocolError(*ctx, f"{where}: expected a list of lists of triples, got {v!r:.120}")
    return [[(_logprob(x, f"{where}[{i}]", ctx), x[1]) for x in (step or [])] for i, step in enumerate(v)]


def _ids_logprobs(v: Any, where: str, ctx) -> list[dict[int, float] | None]:
    """Per position, ``{id: logprob}`` of the ``[logprob, id, text]`` triples asked by ``token_ids_logprob``."""
    if not isinstance(v, list) or not all(step is None or isinstance(step, list) for step in v):
        raise EngineProtocolError(*ctx, f"{where}: expected a list of lists of triples, got {v!r:.120}")
    return [None if step is None else {x[1]: _logprob(x, f"{where}[{i}]", ctx) for x in step}
            for i, step in enumerate(v)]


def parse_generate_item(body: Any, ctx: tuple[str, str], *, expect_logprobs: bool = False) -> GenerateOutput:
    if not isinstance(body, dict):
        raise EngineProtocolError(*ctx, f"expected a JSON object, got {type(body).__name__}")
    ids = _req(body, "output_ids", list, "response", ctx)
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise EngineProtocolError(*ctx, "response.output_ids: not a list of token ids")
    meta = _req(body, "meta_info", dict, "response", ctx)
    rid = _req(meta, "id", str, "meta_info", ctx)
    finish = _finish(meta.get("finish_reason"), ctx)
    lps = None
    if "output_token_logprobs" in meta:
        lps = _logprob_triples(meta["output_token_logprobs"], len(ids), "meta_info.output_token_logprobs", ctx)
    elif expect_logprobs:
        raise EngineProtocolError(*ctx, "meta_info.output_token_logprobs missing although return_logprob was set")
    top = None
    if meta.get("output_top_logprobs") is not None:
        top = _top_logprobs(meta["output_top_logprobs"], "meta_info.output_top_logprobs", ctx)
    inp = None
    if meta.get("input_token_logprobs"):
        v = meta["input_token_logprobs"]
        if not isinstance(v, list):
            raise EngineProtocolError(*ctx, f"meta_info.input_token_logprobs: expected a list, got {v!r:.80}")
        inp = [_logprob(t, f"meta_info.input_token_logprobs[{i}]", ctx, nullable=True) for i, t in enumerate(v)]
    ids_in = ids_out = None
    if meta.get("input_token_ids_logprobs") is not None:
        ids_in = _ids_logprobs(meta["input_token_ids_logprobs"], "meta_info.input_token_ids_logprobs", ctx)
    if meta.get("output_token_ids_logprobs") is not None:
        ids_out = _ids_logprobs(meta["output_token_ids_logprobs"], "meta_info.output_token_ids_logprobs", ctx)
        if any(step is None for step in ids_out):
            raise EngineProtocolError(*ctx, "meta_info.output_token_ids_logprobs: a generated position has none")
    routes = meta.get("routed_experts")
    if routes is not None and not isinstance(routes, str):
        raise EngineProtocolError(*ctx, f"meta_info.routed_experts: expected base64 str, got {type(routes).__name__}")
    version = meta.get("weight_version")
    if not isinstance(version, str):
        raise EngineProtocolError(*ctx, f"meta_info.weight_version: expected str, got {version!r:.40}")
    completion = _count(meta, "completion_tokens", ctx, len(ids))
    if completion != len(ids):
        raise EngineProtocolError(*ctx, f"meta_info.completion_tokens={completion} but {len(ids)} output_ids")
    tags = meta.get(TOKEN_VERSIONS_KEY)
    if tags is not None and (not isinstance(tags, list) or len(tags) != len(ids) or not all(
            isinstance(t, (int, str)) and not isinstance(t, bool) for t in tags)):
        raise EngineProtocolError(*ctx, f"meta_info.{TOKEN_VERSIONS_KEY}: expected one version per output token "
                                  f"({len(ids)}), got {tags!r:.120}")
    return GenerateOutput(
        rid=rid, output_ids=list(ids), output_logprobs=lps, finish=finish, weight_version=version,
        prompt_tokens=_count(meta, "prompt_tokens", ctx), completion_tokens=completion,
        cached_tokens=_count(meta, "cached_tokens", ctx),
        total_retractions=_count(meta, "total_retractions", ctx) or 0,
        routed_experts=routes, output_top_logprobs=top, input_logprobs=inp, token_versions=tags,
        input_token_ids_logprobs=ids_in, output_token_ids_logprobs=ids_out,
    )


def parse_generate(body: Any, ctx: tuple[str, str], *,
                   expect_logprobs: bool = False) -> GenerateOutput | list[GenerateOutput]:
    """One object for a single request; a list for batch input or ``n > 1``."""
    if isinstance(body, list):
        return [parse_generate_item(b, ctx, expect_logprobs=expect_logprobs) for b in body]
    return parse_generate_item(body, ctx, expect_logprobs=expect_logprobs)


def error_message(body: Any, text: str) -> str:
    """The human message of an SGLang error reply, whatever its shape."""
    if isinstance(body, dict):
        if isinstance(body.get("error"), dict):
            return str(body["error"].get("message", body["error"]))
        if "message" in body:
            return str(body["message"])
        if body.get("error_message"):  # LoRA load/unload replies
            return str(body["error_message"])
    return (text or "").strip()[:500] or "<empty body>"


def parse_success(body: Any, ctx: tuple[str, str]) -> str:
    """``{"success": bool, "message": str}`` replies of weight/group endpoints."""
    if not isinstance(body, dict) or not isinstance(body.get("success"), bool):
        raise EngineProtocolError(*ctx, f"expected {{success, message}}, got {body!r:.160}")
    if not body["success"]:
        raise EngineHTTPError(*ctx, 400, str(body.get("message")))
    return str(body.get("message", ""))


def parse_lora_update(body: Any, ctx: tuple[str, str]) -> list[str]:
    """``{"success": bool, "error_message": str, "loaded_adapters": {name: ref}}`` replies of the LoRA
    load/unload endpoints (200 on success, 400 with the same shape on failure). Returns the adapter names
    the engine holds afterwards."""
    if not isinstance(body, dict) or not isinstance(body.get("success"), bool):
        raise EngineProtocolError(*ctx, f"expected {{success, error_message, loaded_adapters}}, got {body!r:.160}")
    if not body["success"]:
        raise EngineHTTPError(*ctx, 400, str(body.get("error_message") or body.get("message")))
    return sorted(body.get("loaded_adapters") or {})


def parse_status_ok(body: Any, ctx: tuple[str, str]) -> None:
    """``{"message": ..., "status": "ok"}`` replies of pause/continue."""
    if not isinstance(body, dict) or body.get("status") != "ok":
        raise EngineProtocolError(*ctx, f"expected status 'ok', got {body!r:.160}")


def parse_model_info(body: Any, ctx: tuple[str, str]) -> dict:
    if not isinstance(body, dict) or not isinstance(body.get("weight_version"), str):
        raise EngineProtocolError(*ctx, f"model_info without a weight_version: {body!r:.160}")
    return body
