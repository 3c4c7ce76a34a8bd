"""The router's aiohttp applications: the public OpenAI API and the loopback admin API.

``create_app`` builds the public app (``/v1/*``, health, ``/workers``, the pages of
:mod:`router.ui`); ``create_admin_app`` builds the admin app (drain, restart, supervisor
reports) that listens on its own address, loopback by default. Both share one
:class:`~router.workers.WorkerPool`, started and stopped with the public app (``cleanup_ctx``).
"""

from __future__ import annotations

import logging
import re
import resource
import uuid

from aiohttp import web

from router import admin, admin_protocol, openai_api, rollout, ui
from router.auth import auth_middleware
from router.batch import api as batch_api
from router.connections import ConnectionGuard, connection_cap, keep_alive_header
from router.embeddings.api import create_embeddings
from router.errors import ApiError
from router.metrics import METRICS, Metrics, metrics_handler, metrics_middleware
from router.openapi import openapi_handler
from router.responses.api import create_response
from router.settings import deployment_id
from router.state import API, REQUEST_ID, Api
from router.workers import State
from worker.contract.logs import REQUEST_ID as LOG_REQUEST_ID

log = logging.getLogger(__name__)

REQUEST_ID_FORM = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
KEPT_HEADERS = frozenset({"allow", "retry-after", "www-authenticate"})  # of aiohttp's own HTTP errors
CONNECTIONS = web.AppKey("connections", ConnectionGuard)


@web.middleware
async def request_id_middleware(request: web.Request, handler):
    """Honour a sane client ``X-Request-ID`` or make one; every log line of the request carries it."""
    rid = request.headers.get("X-Request-ID", "")
    request[REQUEST_ID] = rid if REQUEST_ID_FORM.match(rid) else uuid.uuid4().hex
    token = LOG_REQUEST_ID.set(request[REQUEST_ID])
    try:
        return await handler(request)
    finally:
        LOG_REQUEST_ID.reset(token)


async def echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: every response, streamed or not, error or not, carries the id."""
    rid = request.get(REQUEST_ID)
    if rid:
        response.headers["X-Request-ID"] = rid


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
            headers = {k: v for k, v in exc.headers.items() if k.lower() in KEPT_HEADERS}
            return ApiError(
                exc.status, f"{exc.reason}: {request.method} {request.path[:200]}", code=None, headers=headers
            ).response()
        except ConnectionResetError:
            raise  # the client went away mid-response: nothing to answer
        except Exception:
            log.exception("unhandled error in %s %s", request.method, request.path)
            return ApiError(500, "internal server error").response()

    return middleware


async def health(request: web.Request) -> web.Response:
    """``/health``, ``/health/ready``: 200 when every served model has a ready replica (``?model=NAME``:
    when that one has; 404 for a name not served) and the router accepts requests, else 503.
    ``models`` gives each model's state (:meth:`router.state.Api.model_states`)."""
    api = request.app[API]
    states = api.model_states()
    name = request.query.get("model")
    asked = [api.named(name).name] if name is not None else list(states)
    ok = api.pool.accepting and all(states[m] == "ready" for m in asked)
    body = {"status": "ok" if ok else "unavailable", "ready_workers": len(api.pool.ready_workers()), "models": states}
    return web.json_response(body, status=200 if ok else 503)


async def live(request: web.Request) -> web.Response:
    """Alive, and which deployment this router serves (:func:`router.settings.deployment_id`)."""
    api = request.app[API]
    return web.json_response({"status": "ok", "deployment": deployment_id(api.cfg.router, list(api.models))})


async def workers(request: web.Request) -> web.Response:
    """The worker table (:class:`router.admin_protocol.WorkerTable`)."""
    return web.Response(body=admin_protocol.encode(request.app[API].pool.table()), content_type="application/json")


def metrics_of(api: Api) -> Metrics:
    """The one :class:`Metrics` of this router, shared by its public and admin apps."""
    if api.metrics is None:
        api.metrics = Metrics(api.pool)
    return api.metrics


def create_app(api: Api, file_limit: int | None = None) -> web.Application:
    """The public application. ``api.pool`` is started and closed with it.

    ``file_limit`` (default: this process's soft ``RLIMIT_NOFILE``) bounds the connection cap;
    ``app[CONNECTIONS].attach(runner.server)`` once its runner is set up turns the cap on.
    """
    if file_limit is None:
        file_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    guard = ConnectionGuard(connection_cap(api.cfg.router.max_connections, file_limit), lambda: api.pool.accepting)
    app = web.Application(
        middlewares=[
            request_id_middleware,
            metrics_middleware,
            error_middleware(),
            guard.middleware,
            auth_middleware(lambda r: r.app[API].cfg.router.key_secrets(), is_open=ui.is_open),
        ],
        client_max_size=api.cfg.limits.max_body_bytes,
    )
    app[API] = api
    app[METRICS] = metrics_of(api)
    app[CONNECTIONS] = guard
    app.on_response_prepare.append(echo_request_id)
    app.on_response_prepare.append(guard.on_response_prepare)
    app.on_response_prepare.append(keep_alive_header(api.cfg.router.keepalive_timeout_s))  # after the guard

    async def pool_ctx(app: web.Application):
        await app[API].pool.start()
        yield
        await app[API].pool.close()

    app.cleanup_ctx.append(pool_ctx)
    app.router.add_post("/v1/chat/completions", openai_api.chat_completions)
    app.router.add_post("/v1/completions", openai_api.completions)
    app.router.add_post("/v1/responses", create_response)
    app.router.add_post("/v1/embeddings", create_embeddings)
    batch_api.add_routes(app)  # /v1/files, /v1/batches and the batch runner
    app.router.add_get("/v1/models", openai_api.models)
    app.router.add_get("/v1/models/{model:.+}", openai_api.model)  # a served name may be "org/name"
    app.router.add_get("/health", health)
    app.router.add_get("/health/ready", health)
    app.router.add_get("/health/live", live)
    app.router.add_get("/workers", workers)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/openapi.json", openapi_handler)
    ui.add_routes(app)  # the chat page at /, the status page at /status
    return app


def create_admin_app(api: Api) -> web.Application:
    """The admin application (shares ``api.pool``; does not start it). Its token can be rotated
    live (:mod:`router.rollout`)."""
    app = web.Application(
        middlewares=[
            request_id_middleware,
            metrics_middleware,
            error_middleware(),
            auth_middleware(lambda r: r.app[rollout.TOKENS].valid(), "admin token"),
        ]
    )
    app[API] = api
    app[rollout.TOKENS] = rollout.AdminTokens(api.cfg.router.admin_token)
    app[METRICS] = metrics_of(api)
    app.on_response_prepare.append(echo_request_id)
    app.on_response_prepare.append(keep_alive_header(api.cfg.router.keepalive_timeout_s))
    app.router.add_get("/admin/workers", workers)
    app.router.add_get("/health/live", live)
    app.router.add_get("/admin/batches", batch_api.summary)
    app.router.add_get("/metrics", metrics_handler)
    admin.add_routes(app)
    rollout.add_routes(app)
    return app


__all__ = ["CONNECTIONS", "State", "create_admin_app", "create_app"]
