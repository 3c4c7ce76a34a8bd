"""Reading a request: the body under its size and time limits, JSON with its failures named, the
prompt-length pre-check, and the request's own timeout (``X-Request-Timeout``)."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from aiohttp import web

from router.errors import ApiError
from router.state import API, RequestView


def check_prompt_chars(view: RequestView, text: str, param: str) -> None:
    """400 at once for a text that must be over ``max_prompt_tokens``, however it tokenizes."""
    ceiling = view.max_prompt_tokens * view.longest_token_chars
    if len(text) > ceiling:
        raise ApiError(
            400,
            f"prompt of {len(text)} characters is over the limit of {view.max_prompt_tokens} tokens "
            "(limits.max_prompt_tokens)",
            param=param,
            code="context_length_exceeded",
        )


async def read_body(request: web.Request, limit: int, timeout: float) -> bytes:
    """The raw body, never more than ``limit`` bytes of it in memory: 413 beyond (at once when
    Content-Length says so), 408 when it does not arrive within ``timeout`` seconds."""
    too_large = ApiError(
        413, f"request body exceeds limits.max_body_bytes={limit}", param="body", code="body_too_large"
    )
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout):
            while chunk := await request.content.read(65536):
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(
            408, f"request body not received within {timeout:g}s (router.request_timeout_s)", code="timeout"
        ) from None
    return b"".join(chunks)


_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[{}\[\]]')


def deepest_key(text: str) -> str | None:
    """The top-level key of a JSON object text under which the nesting is deepest (to name the
    field of a body too deep to parse); ``None`` if the text is not an object."""
    depth, key, best, best_depth = 0, None, None, 0
    for m in _JSON_TOKEN.finditer(text):
        tok = m.group()
        if tok[0] == '"':
            if depth == 1:
                key = tok
            continue
        depth += 1 if tok in "{[" else -1
        if depth > best_depth and key is not None:
            best, best_depth = key, depth
    try:
        return json.loads(best) if best is not None else None
    except ValueError:
        return None


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


async def read_json(request: web.Request) -> Any:
    """The body as JSON; 413 over the size limit, 400 for invalid UTF-8 or malformed JSON."""
    cfg = request.app[API].cfg
    raw = await read_body(request, cfg.limits.max_body_bytes, cfg.router.request_timeout_s)
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise ApiError(400, "request body is not valid UTF-8", code="invalid_json") from None
    except RecursionError:
        key = deepest_key(raw.decode("utf-8"))
        where = f"{key}: " if key else ""
        raise ApiError(
            400, f"{where}request body is not valid JSON: nested too deeply", param=key, code="invalid_json"
        ) from None
    except ValueError as exc:  # JSONDecodeError, NaN/Infinity, integers of more than 4300 digits
        raise ApiError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None


TIMEOUT_HEADER = "X-Request-Timeout"


def request_timeout(request: web.Request, view: RequestView) -> float:
    """Seconds this request may take: ``router.request_timeout_s``, or less when the client's
    ``X-Request-Timeout`` header asks for less. Past it: 504, and the work is cancelled."""
    limit = view.cfg.router.request_timeout_s
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return limit
    try:
        asked = float(raw)
    except ValueError:
        asked = -1.0
    if not 0 < asked < float("inf"):
        raise ApiError(
            400,
            f"{TIMEOUT_HEADER} must be a positive number of seconds (got {raw[:32]!r})",
            param=TIMEOUT_HEADER,
            code="invalid_value",
        )
    return min(asked, limit)


def timeout_error(seconds: float) -> ApiError:
    return ApiError(
        504, f"request timed out after {seconds:g}s (router.request_timeout_s or {TIMEOUT_HEADER})", code="timeout"
    )
