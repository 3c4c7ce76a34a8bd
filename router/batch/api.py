"""The Files and Batch API's HTTP handlers, and the batch runner's life with the public app.

``POST /v1/files`` (multipart: ``purpose`` "batch", ``file`` JSONL), ``GET /v1/files[/{id}]``,
``GET /v1/files/{id}/content``, ``DELETE /v1/files/{id}``; ``POST /v1/batches``,
``GET /v1/batches[/{id}]``, ``POST /v1/batches/{id}/cancel``, as OpenAI's API has them. Every
file and batch belongs to the API key that made it (a digest of it, :func:`owner_of`; one owner
for all when the deployment has no keys): another key gets 404 for it and never lists it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time

from aiohttp import web

from router.auth import bearer_token
from router.batch.files import ENDPOINTS, parse_batch_file, read_upload
from router.batch.objects import batch_object, file_object, page
from router.batch.runner import Runner
from router.batch.store import Conflict, Store
from router.bodies import read_json
from router.errors import ApiError
from router.state import API

WINDOWS = {"24h": 24 * 3600}  # OpenAI's only completion window
MAX_METADATA = 16  # key-value pairs, as OpenAI bounds them


class Batches:
    """The store and its runner, one per public app (set while the app serves: :func:`batches_ctx`)."""

    store: Store
    runner: Runner


def owner_of(request: web.Request) -> str:
    """Who a file or batch belongs to: a digest of the request's API key (never the key itself),
    or ``""`` when the deployment has no keys (every caller is the same one)."""
    if not request.app[API].cfg.router.api_keys:
        return ""
    return hashlib.sha256(bearer_token(request).encode("utf-8", "surrogatepass")).hexdigest()


def _retention_s(request: web.Request) -> int:
    return int(request.app[API].cfg.router.batch.retention_days * 86400)


def _limit(request: web.Request, default: int) -> int:
    raw = request.query.get("limit", str(default))
    if not raw.isdigit() or not 1 <= int(raw) <= 10_000:
        raise ApiError(400, f"limit must be an integer in [1, 10000] (got {raw[:20]!r})", param="limit")
    return int(raw)


def _not_found(kind: str, oid: str) -> ApiError:
    return ApiError(404, f"No such {kind}: {oid[:100]}", param="id", code=None)


async def upload_file(request: web.Request) -> web.Response:
    """``POST /v1/files``: checked whole (:mod:`router.batch.files`), then stored."""
    bounds, lim = request.app[API].cfg.router.batch, request.app[API].cfg.limits
    upload = await read_upload(request, bounds.max_file_bytes)
    await asyncio.to_thread(parse_batch_file, upload.content, bounds.max_lines, lim.max_body_bytes)
    store = request.app[API].batches.store
    row = await asyncio.to_thread(
        store.add_file, owner_of(request), upload.purpose, upload.filename, upload.content, int(time.time())
    )
    return web.json_response(file_object(row, _retention_s(request)))


async def list_files(request: web.Request) -> web.Response:
    limit = _limit(request, 10_000)
    order = request.query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, "order must be asc or desc", param="order")
    rows = request.app[API].batches.store.files(
        owner_of(request), request.query.get("purpose"), limit, request.query.get("after"), order == "desc"
    )
    return web.json_response(page([file_object(r, _retention_s(request)) for r in rows], limit))


async def get_file(request: web.Request) -> web.Response:
    fid = request.match_info["file_id"]
    row = request.app[API].batches.store.file(owner_of(request), fid)
    if row is None:
        raise _not_found("File", fid)
    return web.json_response(file_object(row, _retention_s(request)))


async def file_content(request: web.Request) -> web.Response:
    fid = request.match_info["file_id"]
    content = await asyncio.to_thread(request.app[API].batches.store.file_content, owner_of(request), fid)
    if content is None:
        raise _not_found("File", fid)
    return web.Response(body=content, content_type="application/jsonl")


async def delete_file(request: web.Request) -> web.Response:
    fid = request.match_info["file_id"]
    if not await asyncio.to_thread(request.app[API].batches.store.delete_file, owner_of(request), fid):
        raise _not_found("File", fid)
    return web.json_response({"id": fid, "object": "file", "deleted": True})


async def create_batch(request: web.Request) -> web.Response:
    """``POST /v1/batches``: the input file's lines must all ask for ``endpoint``; they are copied
    into the batch (deleting the file afterwards changes nothing)."""
    fid, endpoint, window, metadata = create_args(await read_json(request))
    owner, store = owner_of(request), request.app[API].batches.store
    content = await asyncio.to_thread(store.file_content, owner, fid)
    if content is None:
        raise ApiError(404, f"No such File: {str(fid)[:100]}", param="input_file_id")
    bounds, lim = request.app[API].cfg.router.batch, request.app[API].cfg.limits
    requests = await asyncio.to_thread(parse_batch_file, content, bounds.max_lines, lim.max_body_bytes)
    if wrong := next((r for r in requests if r.url != endpoint), None):
        raise ApiError(
            400,
            f"request {wrong.custom_id[:80]!r} is for {wrong.url}, not the batch's endpoint {endpoint}",
            param="input_file_id",
            code="invalid_url",
        )
    lines = [(r.custom_id, json.dumps(r.body)) for r in requests]
    row = await asyncio.to_thread(
        store.create_batch, owner, endpoint, fid, WINDOWS[window], metadata, lines, int(time.time())
    )
    request.app[API].batches.runner.wake()
    return web.json_response(batch_object(row))


def create_args(body: object) -> tuple[str, str, str, dict | None]:
    """``POST /v1/batches``'s body checked: ``(input_file_id, endpoint, completion_window,
    metadata)``. Raises :class:`ApiError` 400 naming the field, as OpenAI answers (a missing
    ``input_file_id`` is ``missing_required_parameter``, not a 404 for a file named None)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    fid, endpoint, window = body.get("input_file_id"), body.get("endpoint"), body.get("completion_window")
    if fid is None:
        raise ApiError(
            400, "Missing required parameter: 'input_file_id'", param="input_file_id", code="missing_required_parameter"
        )
    if not isinstance(fid, str) or not fid:
        raise ApiError(400, "input_file_id must be a file id (a string)", param="input_file_id", code="invalid_value")
    if endpoint not in ENDPOINTS:
        raise ApiError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}", param="endpoint", code="invalid_value")
    if window not in WINDOWS:
        raise ApiError(400, "completion_window must be '24h'", param="completion_window", code="invalid_value")
    metadata = body.get("metadata")
    if metadata is not None and (problem := metadata_problem(metadata)):
        raise ApiError(400, f"metadata: {problem}", param="metadata", code="invalid_value")
    return fid, endpoint, window, metadata


def metadata_problem(metadata: object) -> str | None:
    """What is wrong with a batch's ``metadata`` (OpenAI's bounds: at most 16 pairs, string keys of
    at most 64 characters, string values of at most 512), or None when it is fine."""
    if not isinstance(metadata, dict):
        return f"must be an object of string keys and values (got {type(metadata).__name__})"
    if len(metadata) > MAX_METADATA:
        return f"at most {MAX_METADATA} pairs (got {len(metadata)})"
    for key, value in metadata.items():
        if len(key) > 64:
            return f"key {key[:20]!r}... is over 64 characters"
        if not isinstance(value, str):
            return f"the value of {key[:64]!r} must be a string (got {type(value).__name__})"
        if len(value) > 512:
            return f"the value of {key[:64]!r} is over 512 characters"
    return None


async def get_batch(request: web.Request) -> web.Response:
    bid = request.match_info["batch_id"]
    row = request.app[API].batches.store.batch(owner_of(request), bid)
    if row is None:
        raise _not_found("Batch", bid)
    return web.json_response(batch_object(row))


async def list_batches(request: web.Request) -> web.Response:
    limit = _limit(request, 20)
    rows = request.app[API].batches.store.batches(owner_of(request), limit, request.query.get("after"))
    return web.json_response(page([batch_object(r) for r in rows], limit))


async def cancel_batch(request: web.Request) -> web.Response:
    bid = request.match_info["batch_id"]
    try:
        row = request.app[API].batches.store.request_cancel(owner_of(request), bid, int(time.time()))
    except Conflict as exc:
        raise ApiError(409, str(exc), code="invalid_state") from None
    if row is None:
        raise _not_found("Batch", bid)
    request.app[API].batches.runner.wake()
    return web.json_response(batch_object(row))


async def batches_ctx(app: web.Application):
    """``cleanup_ctx``: open the store in ``router.state_dir`` and run the runner while the app serves."""
    folder = app[API].cfg.router.state_path()
    store = Store(folder)
    runner = Runner(store, app, folder / "runner.lock")
    app[API].batches.store, app[API].batches.runner = store, runner
    task = asyncio.create_task(runner.run(), name="batch-runner")
    yield
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    store.close()


async def summary(request: web.Request) -> web.Response:
    """``GET /admin/batches`` (admin app): every batch not finished and the last finished ones,
    whoever owns them (:meth:`Store.summary`); ``[]`` before the public app opened the store."""
    batches = request.app[API].batches
    store = getattr(batches, "store", None)
    return web.json_response({"batches": store.summary() if store is not None else []})


def mine(request: web.Request) -> list[dict]:
    """The summary of the caller's own batches (the status page's feed)."""
    store = getattr(request.app[API].batches, "store", None)
    return store.summary(owner_of(request)) if store is not None else []


def add_routes(app: web.Application) -> None:
    """The Files and Batch API's routes, and the runner's context, on the public app."""
    app[API].batches = Batches()
    app.cleanup_ctx.append(batches_ctx)
    app.router.add_post("/v1/files", upload_file)
    app.router.add_get("/v1/files", list_files)
    app.router.add_get("/v1/files/{file_id}", get_file)
    app.router.add_delete("/v1/files/{file_id}", delete_file)
    app.router.add_get("/v1/files/{file_id}/content", file_content)
    app.router.add_post("/v1/batches", create_batch)
    app.router.add_get("/v1/batches", list_batches)
    app.router.add_get("/v1/batches/{batch_id}", get_batch)
    app.router.add_post("/v1/batches/{batch_id}/cancel", cancel_batch)
