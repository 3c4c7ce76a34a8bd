"""Reading an uploaded batch file: the multipart body the SDKs send, and the JSONL check.

A ``purpose: "batch"`` file is checked whole before anything is stored, so a bad one is refused
with a 400 naming its first bad line and leaves nothing behind: UTF-8 text, one JSON object a
line (blank lines skipped), each with a unique non-empty ``custom_id``, ``method: "POST"``, a
``url`` this server runs in a batch and a ``body`` object that does not ask to stream, at most
``router.batch.max_lines`` lines of at most ``limits.max_body_bytes`` each (what the endpoint
itself would take). The body is read in chunks and refused with a 413 as soon as it passes
``router.batch.max_file_bytes``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from aiohttp import web

from router.errors import ApiError

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
PURPOSES = ("batch",)
MAX_CUSTOM_ID = 512  # characters
MULTIPART_SLACK = 64 * 1024  # the multipart framing and the purpose field around the file's bytes


@dataclass(frozen=True)
class Upload:
    purpose: str
    filename: str
    content: bytes


def bad_file(message: str, code: str = "invalid_file") -> ApiError:
    return ApiError(400, message, param="file", code=code)


def too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"the file is over the limit of {limit} bytes (router.batch.max_file_bytes)",
        param="file",
        code="file_too_large",
    )


async def read_upload(request: web.Request, limit: int) -> Upload:
    """The ``purpose`` and ``file`` fields of a ``multipart/form-data`` upload; 400 when one is
    missing or the body is not multipart, 413 past ``limit`` bytes of file."""
    if request.content_length is not None and request.content_length > limit + MULTIPART_SLACK:
        raise too_large(limit)
    if not request.content_type.startswith("multipart/"):
        raise ApiError(400, "upload a file as multipart/form-data with the fields purpose and file", param="file")
    reader = await request.multipart()
    purpose, filename, content = None, None, None
    while (part := await reader.next()) is not None:
        if part.name == "purpose":
            purpose = (await part.read(decode=True)).decode("utf-8", "replace").strip()
        elif part.name == "file":
            filename = part.filename or "upload.jsonl"
            content = await _read_capped(part, limit)
    if not purpose:
        raise ApiError(400, "purpose is required (batch)", param="purpose", code="invalid_value")
    if purpose not in PURPOSES:
        raise ApiError(
            400, f"purpose {purpose[:40]!r} is not supported: only 'batch'", param="purpose", code="invalid_value"
        )
    if content is None:
        raise bad_file("file is required")
    return Upload(purpose, filename[:255], content)


async def _read_capped(part, limit: int) -> bytes:
    chunks, size = [], 0
    while chunk := await part.read_chunk(256 * 1024):
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


@dataclass(frozen=True)
class Request:
    """One line of a batch input file."""

    custom_id: str
    url: str
    body: dict


def parse_batch_file(content: bytes, max_lines: int, max_line_bytes: int) -> list[Request]:
    """The requests of a batch input file, in order; a 400 naming the first bad line (module docstring)."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        raise bad_file("the file is not UTF-8 text", "invalid_jsonl") from None
    out: list[Request] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        if len(out) == max_lines:
            raise bad_file(f"the file has more than {max_lines} requests (router.batch.max_lines)", "too_many_requests")
        if len(raw.encode()) > max_line_bytes:
            raise bad_file(f"line {number} is over {max_line_bytes} bytes (limits.max_body_bytes)", "line_too_large")
        request = _parse_line(raw, number)
        if request.custom_id in seen:
            raise bad_file(f"line {number}: custom_id {request.custom_id[:80]!r} is used twice", "duplicate_custom_id")
        seen.add(request.custom_id)
        out.append(request)
    if not out:
        raise bad_file("the file has no requests", "empty_file")
    return out


def _parse_line(raw: str, number: int) -> Request:
    try:
        line = json.loads(raw)
    except ValueError as exc:
        raise bad_file(f"line {number} is not valid JSON: {exc}", "invalid_json_line") from None
    if not isinstance(line, dict):
        raise bad_file(f"line {number} is not a JSON object", "invalid_json_line")
    custom_id, url, body = line.get("custom_id"), line.get("url"), line.get("body")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
        raise bad_file(
            f"line {number}: custom_id must be a non-empty string of at most {MAX_CUSTOM_ID} characters",
            "missing_custom_id",
        )
    if line.get("method") != "POST":
        raise bad_file(f"line {number}: method must be 'POST'", "invalid_method")
    if url not in ENDPOINTS:
        raise bad_file(
            f"line {number}: url must be one of {', '.join(ENDPOINTS)} (got {str(url)[:80]!r})", "invalid_url"
        )
    if not isinstance(body, dict):
        raise bad_file(f"line {number}: body must be a JSON object", "invalid_body")
    if body.get("stream"):
        raise bad_file(f"line {number}: stream is not supported in a batch", "invalid_body")
    return Request(custom_id, url, body)
