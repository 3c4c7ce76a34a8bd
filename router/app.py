"""The router's aiohttp applications: the public OpenAI API and the loopback admin API.

``create_app`` builds the public app (``/v1/*``, health, ``/workers``); ``create_admin_app``
builds the admin app (drain, restart, supervisor reports) that listens on its own address,
loopback by default. Both share one :class:`~router.workers.WorkerPool`, started and stopped
with the public app (``cleanup_ctx``).
"""

from __future__ import annotations

import hmac
import logging
import re
import uuid

from aiohttp import web

from router import admin, openai_api
from router.errors import ApiError
from router.openai_api import API, Api
from router.workers import State

log = logging.getLogger(__name__)

REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def bearer_ok(request: web.Request, secrets: list[str]) -> bool:
    """True when the ``Authorization: Bearer`` token equals one of ``secrets`` (constant time)."""
    header = request.headers.get("Authorization", "")
    token = header[7:].strip() if header[:7].lower() == "bearer " else ""
    return any(hmac.compare_digest(token.encode(), s.encode()) for s in secrets) and bool(token)


@web.middleware
async def request_id_middleware(request: web.Request, handler):
    """Honour a sane client ``X-Request-ID`` or make one; echo it on every response."""
    rid = request.headers.get("X-Request-ID", "")
    request["request_id"] = rid if REQUEST_ID.match(rid) else uuid.uuid4().hex
    resp = await handler(request)
    if not resp.prepared:
        resp.headers["X-Request-ID"] = request["request_id"]
    return resp


def error_middleware():
    @web.middleware
    async def middleware(request: web.Request, handler):
        try:
            return await handler(request)
        except ApiError as exc:
            log.info("%s %s -> %d %s", request.method, request.path, exc.status, exc.message)
            return exc.response()
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return ApiError(exc.status, exc.reason or "error", code=None, headers=dict(exc.headers)).response()
        except Exception:
            log.exception("unhandled error in %s %s", request.method, request.path)
            return ApiError(500, "internal server error").response()

    return middleware


def auth_middleware(secrets_of):
    """Require a bearer token from ``secrets_of(request)`` when that list is non-empty."""
    @web.middleware
    async def middleware(request: web.Request, handler):
        secrets = secrets_of(request)
        if secrets and request.path not in ("/health", "/health/live", "/health/ready") and not bearer_ok(request, secrets):
            raise ApiError(401, "invalid or missing API key (Authorization: Bearer ...)", code="invalid_api_key")
        return await handler(request)

    return middleware


async def health(request: web.Request) -> web.Response:
    ready = request.app[API].pool.ready_workers()
    status = 200 if ready and request.app[API].pool.accepting else 503
    return web.json_response({"status": "ok" if status == 200 else "unavailable", "ready_workers": len(ready)}, status=status)


async def live(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def workers(request: web.Request) -> web.Response:
    pool = request.app[API].pool
    return web.json_response({"policy": pool.policy.name, "accepting": pool.accepting,
                              "workers": [w.info() for w in sorted(pool.workers.values(), key=lambda w: w.worker_id)]})


def create_app(api: Api) -> web.Application:
    """The public application. ``api.pool`` is started and closed with it."""
    app = web.Application(
        middlewares=[request_id_middleware, error_middleware(),
                     auth_middleware(lambda r: r.app[API].cfg.router.api_keys)],
        client_max_size=api.cfg.limits.max_body_bytes)
    app[API] = api

    async def pool_ctx(app: web.Application):
        await app[API].pool.start()
        yield
        await app[API].pool.close()

    app.cleanup_ctx.append(pool_ctx)
    app.router.add_post("/v1/chat/completions", openai_api.chat_completions)
    app.router.add_post("/v1/completions", openai_api.completions)
    app.router.add_get("/v1/models", openai_api.models)
    app.router.add_get("/health", health)
    app.router.add_get("/health/ready", health)
    app.router.add_get("/health/live", live)
    app.router.add_get("/workers", workers)
    return app


def create_admin_app(api: Api) -> web.Application:
    """The admin application (shares ``api.pool``; does not start it)."""
    token = api.cfg.router.admin_token
    app = web.Application(middlewares=[request_id_middleware, error_middleware(),
                                       auth_middleware(lambda r: [token] if token else [])])
    app[API] = api
    app.router.add_get("/admin/workers", workers)
    admin.add_routes(app)
    return app


__all__ = ["create_app", "create_admin_app", "State"]
