"""Admin endpoints: drain, undrain, restart, start one worker; supervisor reports; graceful shutdown.

Restart is cooperative: the router drains the worker (no new requests, wait for in-flight ones up
to a timeout), then sends it ``Shutdown``; the worker exits with code 0 and the launcher's
supervisor starts it again on the same device, where it says Hello and rejoins once ready. A
worker without a process (``failed``, or ``dead`` and waiting for its backoff) cannot be told
anything: restarting or starting it sets ``start_requested`` and pushes a
:class:`~router.admin_protocol.StartRequested` event to the supervisor, which starts it at once.

The supervisor's own reports, typed in :mod:`router.admin_protocol`: ``POST .../started`` (a new
process: pid, restart count) and ``POST .../exited`` (a process ended: reason, failed).
"""

from __future__ import annotations

import logging

from aiohttp import web

from router import admin_protocol
from router.admin_protocol import Exited, Started
from router.errors import ApiError
from router.policies.registry import POLICIES
from router.state import API
from router.workers import State

log = logging.getLogger(__name__)


def _worker_id(request: web.Request) -> int:
    try:
        return int(request.match_info["worker_id"])
    except ValueError:
        raise ApiError(400, "worker id must be an integer", param="worker_id") from None


def _float(request: web.Request, name: str, default: float) -> float:
    try:
        value = float(request.query.get(name, default))
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise ApiError(400, f"{name} must be a number of seconds >= 0", param=name)
    return value


async def _body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except ValueError:
        raise ApiError(400, "request body is not valid JSON", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    return body


async def drain(request: web.Request) -> web.Response:
    api = request.app[API]
    wid = _worker_id(request)
    emptied = await api.pool.drain(wid, _float(request, "timeout", api.cfg.supervisor.drain_timeout_s))
    return web.json_response({"worker": api.pool.get(wid).info(), "drained": emptied})


async def undrain(request: web.Request) -> web.Response:
    api = request.app[API]
    wid = _worker_id(request)
    api.pool.undrain(wid)
    return web.json_response({"worker": api.pool.get(wid).info()})


async def restart(request: web.Request) -> web.Response:
    """``?drain=1`` waits for in-flight requests first (``timeout`` seconds at most). A worker
    with no process (failed, dead) is started again instead."""
    api = request.app[API]
    wid = _worker_id(request)
    if api.pool.request_start(wid):
        log.info("worker %d is %s: asking the supervisor to start it", wid, api.pool.get(wid).state.value)
        return web.json_response({"worker": api.pool.get(wid).info(), "drained": True, "restarting": True})
    emptied = True
    if request.query.get("drain", "0").lower() in ("1", "true", "yes"):
        emptied = await api.pool.drain(wid, _float(request, "timeout", api.cfg.supervisor.drain_timeout_s))
    log.info("restarting worker %d (drained: %s)", wid, emptied)
    await api.pool.shutdown_worker(wid, "restart requested")
    return web.json_response({"worker": api.pool.get(wid).info(), "drained": emptied, "restarting": True})


async def start(request: web.Request) -> web.Response:
    """Put a worker back into service: a draining one becomes ready, a failed or dead one is
    started again (its crash history cleared). ``action`` says which; ``none`` if it needed neither."""
    api = request.app[API]
    wid = _worker_id(request)
    action = "none"
    if api.pool.get(wid).state == State.DRAINING:
        api.pool.undrain(wid)
        action = "undrained"
    elif api.pool.request_start(wid):
        action = "starting"
    log.info("start worker %d: %s", wid, action)
    return web.json_response({"worker": api.pool.get(wid).info(), "action": action})


async def _report(request: web.Request, type_: type):
    """The supervisor's report in the body, as ``type_``; 400 naming the problem otherwise."""
    try:
        return admin_protocol.decode(await request.read(), type_)
    except ValueError as exc:  # msgspec's DecodeError and ValidationError
        raise ApiError(400, f"invalid {type_.__name__} report: {exc}", code="invalid_value") from None


async def started(request: web.Request) -> web.Response:
    """The supervisor started a process (:class:`~router.admin_protocol.Started`)."""
    api = request.app[API]
    wid = _worker_id(request)
    api.pool.on_report(wid, await _report(request, Started))
    return web.json_response({"worker": api.pool.get(wid).info()})


async def exited(request: web.Request) -> web.Response:
    """The supervisor reports that a worker process ended (:class:`~router.admin_protocol.Exited`)."""
    api = request.app[API]
    wid = _worker_id(request)
    api.pool.on_report(wid, await _report(request, Exited))
    return web.json_response({"worker": api.pool.get(wid).info()})


async def shutdown(request: web.Request) -> web.Response:
    """Refuse new requests (503) and wait up to ``grace`` seconds for in-flight ones to finish."""
    api = request.app[API]
    api.pool.stop_accepting()
    grace = _float(request, "grace", api.cfg.supervisor.shutdown_grace_s)
    done = await api.pool.wait_idle(list(api.pool.workers.values()), grace)
    return web.json_response({"idle": done, "in_flight": sum(w.in_flight for w in api.pool.workers.values())})


async def set_policy(request: web.Request) -> web.Response:
    """Switch the load-balancing policy at run time: ``{"policy": NAME}``, NAME in :data:`router.policies.registry.POLICIES`."""
    api = request.app[API]
    body = await _body(request)
    name = body.get("policy")
    if name not in POLICIES:
        raise ApiError(400, f"policy must be one of {sorted(POLICIES)}", param="policy")
    api.pool.routing.set_policy(name)
    log.info("policy set to %s", name)
    return web.json_response({"policy": name})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/admin/policy", set_policy)
    app.router.add_post("/admin/workers/{worker_id}/drain", drain)
    app.router.add_post("/admin/workers/{worker_id}/undrain", undrain)
    app.router.add_post("/admin/workers/{worker_id}/restart", restart)
    app.router.add_post("/admin/workers/{worker_id}/start", start)
    app.router.add_post("/admin/workers/{worker_id}/started", started)
    app.router.add_post("/admin/workers/{worker_id}/exited", exited)
    app.router.add_post("/admin/shutdown", shutdown)
