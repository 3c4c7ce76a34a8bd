"""The documentation site at ``/docs/``: the MkDocs build of ``docs/``, served read-only and offline.

``scripts/setup.sh`` builds the site into ``router/docs_site/`` (ignored by git; ``mkdocs.yml``
names it). This module serves that folder's files as they are: a folder's ``index.html`` for a
path ending in ``/``, nothing outside the folder (paths are resolved and must stay inside it), and
404 with the command that builds the site when it was not built. Like the pages
(:mod:`router.ui`) the site holds no data, so it loads without an API key.

Every page is served under a ``Content-Security-Policy`` that allows only this origin: the theme
loads no web font and no CDN script (``theme.font: false``), and its search runs in a web worker
over ``search/search_index.json``, both from here. Material puts a few small scripts inline in
each page; instead of allowing inline script, the policy lists each one's SHA-256, computed from
the file served, so a script that is not in the built page cannot run.
"""

from __future__ import annotations

import base64
import hashlib
import mimetypes
import re
from pathlib import Path

from aiohttp import web

from router.errors import ApiError

SITE_DIR = Path(__file__).parent / "docs_site"
PREFIX = "/docs/"
SITE_KEY = web.AppKey("docs_site", Path)  # set only by tests that serve a site built elsewhere
BUILD_HINT = "the documentation is not built here: run `bash scripts/setup.sh` (or `.venv/bin/mkdocs build`)"

_INLINE_SCRIPT = re.compile(rb"<script(?![^>]*\bsrc=)(?![^>]*application/json)[^>]*>(.*?)</script>", re.S)
_BASE_CSP = (
    "default-src 'none'; script-src 'self'{hashes}; style-src 'self'; img-src 'self' data:; font-src 'self'; "
    "connect-src 'self'; worker-src 'self'; manifest-src 'self'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}


def is_docs(path: str) -> bool:
    """True for the site's paths (served without an API key, as the pages are)."""
    return path == "/docs" or path.startswith(PREFIX)


def csp_for(body: bytes) -> str:
    """The policy for one HTML page: this origin only, plus the hash of each inline script in ``body``."""
    hashes = sorted(
        {base64.b64encode(hashlib.sha256(m.group(1)).digest()).decode() for m in _INLINE_SCRIPT.finditer(body)}
    )
    return _BASE_CSP.format(hashes="".join(f" 'sha256-{h}'" for h in hashes))


def resolve(site: Path, rel: str) -> Path | None:
    """The file ``rel`` (the URL path below ``/docs/``) names inside ``site``, or ``None`` when it
    is not a file there (or would leave the folder)."""
    root = site.resolve()
    path = (root / rel).resolve()
    if path != root and root not in path.parents:
        return None
    if path.is_dir():
        path = path / "index.html"
    return path if path.is_file() else None


def _response(path: Path, status: int = 200) -> web.Response:
    body = path.read_bytes()
    content_type = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    charset = (
        "utf-8" if content_type.startswith("text/") or content_type.endswith(("+xml", "json", "javascript")) else None
    )
    headers = dict(HEADERS)
    headers["Content-Security-Policy"] = csp_for(body) if content_type == "text/html" else _BASE_CSP.format(hashes="")
    return web.Response(body=body, status=status, content_type=content_type, charset=charset, headers=headers)


async def serve(request: web.Request) -> web.StreamResponse:
    """``GET /docs/{path}``: a file of the built site; ``/docs`` redirects to ``/docs/``."""
    if request.path == "/docs":
        raise web.HTTPMovedPermanently(PREFIX)
    site = request.app.get(SITE_KEY, SITE_DIR)
    if not (site / "index.html").is_file():
        raise ApiError(404, BUILD_HINT, code="not_found")
    rel = request.match_info.get("path", "")
    path = resolve(site, rel)
    if path is None:
        missing = site / "404.html"
        if missing.is_file():
            return _response(missing, status=404)
        raise ApiError(404, f"no documentation page {rel[:100]!r}", code="not_found")
    if rel and not rel.endswith("/") and path.name == "index.html" and not rel.endswith("index.html"):
        raise web.HTTPMovedPermanently(f"{PREFIX}{rel}/")  # relative links inside the page need the slash
    return _response(path)


def add_routes(app: web.Application) -> None:
    """``/docs`` and everything below it, read-only."""
    app.router.add_get("/docs", serve)
    app.router.add_get(PREFIX + "{path:.*}", serve)
