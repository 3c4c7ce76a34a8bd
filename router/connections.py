"""HTTP connection policy of the public app: a cap on open connections, and ``Connection: close``
once the router stops accepting requests.

* Past :attr:`ConnectionGuard.cap` open connections, each request on a connection beyond the cap
  (the newest ones) gets a 503 ``too_many_connections`` with ``Retry-After: 1`` and
  ``Connection: close``, and the connection is closed after it; connections within the cap are
  served as usual. The cap stays below the
  process's open-file limit, so accepting a connection never fails with EMFILE (which asyncio
  answers by pausing every accept for a second) and the ZeroMQ sockets and files keep their
  descriptors. ``GET /health/live`` is exempt: a loaded router is still alive.
* From the moment the router stops accepting (``POST /admin/shutdown``, which the launcher sends
  on SIGTERM, or SIGTERM to the router itself), every response carries ``Connection: close`` and
  its connection is closed after it, so a pooled client (Reactor Netty, the JDK client, Apache
  HttpClient) never sends its next request onto a socket that is about to close.
* Every response whose connection stays open says for how long it may idle:
  ``Keep-Alive: timeout=N``, N a little below ``router.keepalive_timeout_s`` (the idle time after
  which aiohttp closes it), as nginx and Apache httpd send, so a pooled client (the JDK's
  HttpClient, Apache HttpClient, Node's undici) drops an idle socket before the server closes it
  instead of sending its next request onto it and seeing a reset.
"""

from __future__ import annotations

import logging
import math
import resource

from aiohttp import hdrs, web

from router.errors import ApiError

log = logging.getLogger(__name__)

RESERVED_FDS = 256  # admin API connections, ZeroMQ sockets, the tokenizer's and logs' files
UNCAPPED_PATHS = frozenset({"/health/live"})


def raise_file_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit; return the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
    return soft


def connection_cap(configured: int | None, file_limit: int) -> int:
    """The cap on open public connections: ``configured`` (``router.max_connections``), at most the
    file limit less :data:`RESERVED_FDS` (or less a tenth of it, whichever is more); that ceiling
    when ``configured`` is None."""
    ceiling = max(1, file_limit - max(RESERVED_FDS, file_limit // 10))
    if configured is None:
        return ceiling
    if configured > ceiling:
        log.warning(
            "router.max_connections %d is too close to the open-file limit %d; using %d",
            configured,
            file_limit,
            ceiling,
        )
    return min(configured, ceiling)


class TooManyConnections(ApiError):
    def __init__(self, cap: int) -> None:
        super().__init__(
            503,
            f"more than {cap} open connections (router.max_connections); retry later",
            code="too_many_connections",
            headers={"Retry-After": "1"},
        )


class ConnectionGuard:
    """Applies the policy above to one app; :meth:`attach` gives it the server whose connections
    it counts (``AppRunner.server``, known once the runner is set up)."""

    def __init__(self, cap: int, accepting) -> None:
        self.cap = cap
        self.accepting = accepting  # () -> bool: False once the router is shutting down
        self.server: web.Server | None = None

    def attach(self, server: web.Server) -> None:
        self.server = server

    def over_cap(self, request: web.Request) -> bool:
        """True when ``request``'s connection is one of those past the cap (the newest)."""
        if self.server is None:
            return False
        connections = self.server.connections  # in the order they were opened
        return len(connections) > self.cap and request.protocol in connections[self.cap :]

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        if request.path not in UNCAPPED_PATHS and self.over_cap(request):
            raise TooManyConnections(self.cap)
        return await handler(request)

    async def on_response_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        """Close the connection after this response when shutting down or when it is past the cap."""
        if not self.accepting() or self.over_cap(request):
            response.headers[hdrs.CONNECTION] = "close"
            response.force_close()


def keep_alive_seconds(idle_timeout_s: float) -> int:
    """The ``timeout`` a ``Keep-Alive`` header announces for a server that closes idle connections
    after ``idle_timeout_s``: 10 % (at least 1 s) less, so a request sent at the announced limit
    still arrives before the close; at least 1."""
    return max(1, math.floor(idle_timeout_s - max(1.0, idle_timeout_s / 10)))


def keep_alive_header(idle_timeout_s: float):
    """An ``on_response_prepare`` hook (append it after any hook that may close the connection)
    adding ``Keep-Alive: timeout=N`` (:func:`keep_alive_seconds`) to every response whose
    connection stays open."""
    value = f"timeout={keep_alive_seconds(idle_timeout_s)}"

    async def on_response_prepare(request: web.Request, response: web.StreamResponse) -> None:
        keep = response.keep_alive if response.keep_alive is not None else request.keep_alive
        if keep and response.headers.get(hdrs.CONNECTION, "").lower() != "close":
            response.headers[hdrs.KEEP_ALIVE] = value

    return on_response_prepare
