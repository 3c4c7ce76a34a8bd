"""The router's two web pages: a chat page at ``/`` and a live status page at ``/status``.

Both are static files of this package (``router/pages/``: HTML, CSS and JavaScript modules, nothing
fetched from anywhere else) served under a ``Content-Security-Policy`` that allows only this origin,
no inline script and no framing. The pages themselves hold no data, so they load without an API
key; every call they make for data (``/v1/*``, ``/workers``, ``/activity``) needs one when
``router.api_keys`` is set, which the page asks for once and keeps in the tab's sessionStorage.

``GET /activity`` is the status page's feed beside ``GET /workers``: the router's recent
throughput and TTFT (:mod:`router.activity`), the last worker events (:mod:`router.events`) and
each worker's prefix-cache counters.

Admin actions from the status page: the admin API listens on its own, loopback address, which a
browser elsewhere cannot reach. So the public app serves a small proxy of it under
``/status/admin/``: drain, undrain, restart and start one worker, the same handlers as
``/admin/workers/{id}/...``. It exists only when ``router.admin_token`` is set (404 otherwise: a
public port must not open admin actions that the loopback admin API leaves open without a token),
and every call must carry that token in ``X-Admin-Token`` (the ``Authorization`` header holds the
API key), compared in constant time.
"""

from __future__ import annotations

import mimetypes
from pathlib import Path

from aiohttp import web

from router import admin, docs_site
from router.auth import OPEN_PATHS, token_matches
from router.batch import api as batch_api
from router.errors import ApiError
from router.state import API
from router.workers import WorkerPool
from worker.contract.protocol import EngineLoad

PAGES_DIR = Path(__file__).parent / "pages"
PAGES = {"/": "index.html", "/status": "status.html", "/favicon.ico": "icon.svg"}  # browsers ask for the icon
ASSET_PREFIX = "/pages/"
ADMIN_HEADER = "X-Admin-Token"
ADMIN_ACTIONS = {"drain": admin.drain, "undrain": admin.undrain, "restart": admin.restart, "start": admin.start}
EVENTS_SHOWN = 60

# Only this origin, nothing inline (scripts are modules from /pages/; styles are files), no framing.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "font-src 'self'; manifest-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}
TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html", ".svg": "image/svg+xml"}


def is_open(path: str) -> bool:
    """True for the paths served without an API key: health probes, the pages and their assets, and
    the documentation site (:mod:`router.docs_site`): none of them holds data."""
    return path in OPEN_PATHS or path in PAGES or path.startswith(ASSET_PREFIX) or docs_site.is_docs(path)


def _file_response(path: Path) -> web.Response:
    content_type = TYPES.get(path.suffix) or mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    charset = "utf-8" if content_type.startswith("text/") or content_type.endswith("+xml") else None
    return web.Response(body=path.read_bytes(), content_type=content_type, charset=charset, headers=PAGE_HEADERS)


async def page(request: web.Request) -> web.Response:
    """``/`` (chat), ``/status`` and the icon at ``/favicon.ico``."""
    return _file_response(PAGES_DIR / PAGES[request.path])


async def asset(request: web.Request) -> web.Response:
    """A file of ``router/pages/`` by its plain name (no folders, so no way out of it)."""
    name = request.match_info["name"]
    path = PAGES_DIR / name
    if "/" in name or name.startswith(".") or not path.is_file():
        raise ApiError(404, f"no page asset {name[:100]!r}", code="not_found")
    return _file_response(path)


def prefix_counters(pool: WorkerPool) -> dict[str, dict[str, int]]:
    """Each worker's prefix-cache counters from its last load report, keyed by worker id as a
    string: ``hit_tokens``, ``queried_tokens``, ``preemptions`` (0 before its first report)."""
    out = {}
    for wid, w in sorted(pool.workers.items()):
        load = w.load or EngineLoad()
        out[str(wid)] = {
            "hit_tokens": load.prefix_hit_tokens,
            "queried_tokens": load.prefix_queried_tokens,
            "preemptions": load.preemptions,
        }
    return out


async def activity(request: web.Request) -> web.Response:
    """The status page's feed: ``history`` (:meth:`router.activity.Activity.history`), ``events``
    (newest first, :meth:`router.events.EventLog.recent`), ``prefix_cache`` per worker id
    (``hit_tokens``, ``queried_tokens``, ``preemptions`` since its process started), ``model`` (the
    one a request without ``model`` goes to), ``models`` (every served name, in deploy.yaml's order),
    ``admin_controls`` (whether ``/status/admin/`` exists: an admin token is configured),
    ``batches`` (the caller's batches and their progress, :func:`router.batch.api.mine`),
    ``model_states`` (name -> ``ready``/``loading``/``unavailable``), ``held`` and ``held_oldest_s``
    (requests held for a replica per model, and the longest wait so far in seconds; ``""``: the
    one-model queue; :mod:`router.hold`)."""
    api = request.app[API]
    metrics = api.metrics
    return web.json_response(
        {
            "model": api.default_model.name,
            "models": list(api.models),
            "history": metrics.activity.history() if metrics is not None else None,
            "events": api.pool.events.recent(EVENTS_SHOWN),
            "prefix_cache": prefix_counters(api.pool),
            "admin_controls": bool(api.cfg.router.admin_token),
            "model_states": api.model_states(),
            "held": api.pool.hold.by_model(),
            "held_oldest_s": api.pool.hold.oldest_s(),
            "batches": batch_api.mine(request),
        }
    )


def _check_admin(request: web.Request) -> None:
    token = request.app[API].cfg.router.admin_token
    if not token:
        raise ApiError(404, "admin actions are not served on this port: no router.admin_token is set", code="not_found")
    if not token_matches(request.headers.get(ADMIN_HEADER, ""), [token]):
        raise ApiError(
            401, f"invalid or missing admin token (send '{ADMIN_HEADER}: <admin token>')", code="invalid_admin_token"
        )


async def admin_check(request: web.Request) -> web.Response:
    """``GET /status/admin``: 200 when the request carries the admin token (the page shows its controls)."""
    _check_admin(request)
    return web.json_response({"admin": True})


async def admin_action(request: web.Request) -> web.Response:
    """``POST /status/admin/workers/{worker_id}/{action}``: the admin API's handler of that action."""
    _check_admin(request)
    handler = ADMIN_ACTIONS.get(request.match_info["action"])
    if handler is None:
        raise ApiError(404, f"action must be one of {sorted(ADMIN_ACTIONS)}", param="action", code="not_found")
    return await handler(request)


def add_routes(app: web.Application) -> None:
    """The pages, their assets, their feed, the admin proxy and the documentation, on the public app."""
    docs_site.add_routes(app)
    for path in PAGES:
        app.router.add_get(path, page)
    app.router.add_get(ASSET_PREFIX + "{name}", asset)
    app.router.add_get("/activity", activity)
    app.router.add_get("/status/admin", admin_check)
    app.router.add_post("/status/admin/workers/{worker_id}/{action}", admin_action)
