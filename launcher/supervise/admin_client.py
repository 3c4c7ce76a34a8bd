"""A small synchronous client for the router's admin API (loopback), used by the supervisor and the CLI.

The supervisor's calls are typed (:mod:`router.admin_protocol`): :meth:`AdminClient.table` and
:meth:`AdminClient.report`; the CLI's are plain JSON (:meth:`AdminClient.call`).
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request

from router import admin_protocol
from router.admin_protocol import Exited, Started, WorkerTable

log = logging.getLogger(__name__)


class AdminError(OSError):
    """The admin API answered with an error; ``str()`` is the router's message."""


class AdminClient:
    """Tiny synchronous client for the router's admin API (loopback)."""

    def __init__(self, base_url: str, token: str | None):
        self.base = base_url.rstrip("/")
        self.token = token

    def request(self, method: str, path: str, data: bytes | None = None, timeout: float = 5.0) -> bytes:
        """One call; returns the raw body. Raises :class:`AdminError` on an HTTP error, OSError when
        nothing answers."""
        data = data if data is not None else (b"" if method == "POST" else None)
        req = urllib.request.Request(
            self.base + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.read()
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = exc.reason
            raise AdminError(f"HTTP {exc.code}: {message}") from None

    def call(self, method: str, path: str, body: dict | None = None, timeout: float = 5.0) -> dict:
        return json.loads(self.request(method, path, json.dumps(body).encode() if body is not None else None, timeout))

    def try_call(self, method: str, path: str, body: dict | None = None, timeout: float = 5.0) -> dict | None:
        """:meth:`call`, or None (logged at DEBUG) when it fails: for pollers that try again anyway."""
        try:
            return self.call(method, path, body, timeout)
        except (OSError, ValueError) as exc:
            log.debug("admin %s %s failed: %s", method, path, exc)
            return None

    def table(self, timeout: float = 2.0) -> WorkerTable:
        """``GET /admin/workers`` decoded. Raises OSError (unreachable, HTTP error) or ValueError
        (a table that does not match the contract)."""
        return admin_protocol.decode(self.request("GET", "/admin/workers", timeout=timeout), WorkerTable)

    def report(self, worker_id: int, msg: Started | Exited, timeout: float = 5.0) -> None:
        """Post the supervisor's report on one slot (``.../started`` or ``.../exited``)."""
        kind = "started" if isinstance(msg, Started) else "exited"
        self.request("POST", f"/admin/workers/{worker_id}/{kind}", admin_protocol.encode(msg), timeout)
