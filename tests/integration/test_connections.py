"""HTTP connection handling of the router's public app, in process, over raw HTTP/1.1 sockets:
``Connection: close`` once shutting down, the keep-alive idle timeout, the open-connection cap."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

from launcher.config import parse_config
from router.connections import keep_alive_seconds
from router.serve import start_servers, stop_servers
from router.state import Api
from router.workers import WorkerPool
from tests.helpers.deployment import free_port, wait_for_async


class Conn:
    """One raw keep-alive HTTP/1.1 connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> Conn:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    async def request(self, method: str, path: str) -> tuple[int, dict[str, str], bytes]:
        """Send one request (keep-alive, no body); return status, headers (lowercase), body."""
        self.writer.write(f"{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Length: 0\r\n\r\n".encode())
        await self.writer.drain()
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), 10)
        status_line, *lines = head.decode().split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines if line)}
        body = await asyncio.wait_for(self.reader.readexactly(int(headers.get("content-length", 0))), 10)
        return int(status_line.split()[1]), headers, body

    async def closed_by_server(self, timeout: float = 10) -> bool:
        """True once the server closes the connection (EOF) within ``timeout`` seconds."""
        return await asyncio.wait_for(self.reader.read(1), timeout) == b""

    def close(self) -> None:
        self.writer.close()


def serve(tmp_path, test: Callable[[Api, list], Awaitable[None]], **router) -> None:
    """Run ``test(api, runners)`` against a router (no workers) listening on free ports."""
    cfg = parse_config({"router": {"port": free_port(), "admin_port": free_port(), **router}}).router_settings()

    async def main() -> None:
        api = Api(cfg, WorkerPool(f"ipc://{tmp_path}/router.sock", "round_robin", 10.0))
        runners = await start_servers(api)
        try:
            await test(api, runners)
        finally:
            await stop_servers(api, runners)

    asyncio.run(main())


def test_responses_say_connection_close_once_shutting_down(tmp_path):
    async def test(api: Api, runners) -> None:
        pooled = await Conn.open(api.cfg.router.port)
        status, headers, _ = await pooled.request("GET", "/health/live")
        assert status == 200 and "connection" not in headers  # HTTP/1.1: kept alive
        admin = await Conn.open(api.cfg.router.admin_port)
        status, _, _ = await admin.request("POST", "/admin/shutdown?grace=0")
        assert status == 200
        status, headers, _ = await pooled.request("GET", "/health/live")  # the pooled connection's next request
        assert status == 200 and headers["connection"].lower() == "close"
        assert await pooled.closed_by_server()
        fresh = await Conn.open(api.cfg.router.port)
        _, headers, _ = await fresh.request("GET", "/v1/models")
        assert headers["connection"].lower() == "close" and await fresh.closed_by_server()
        admin.close()

    serve(tmp_path, test)


def test_idle_keepalive_connection_is_closed_after_the_configured_timeout(tmp_path):
    async def test(api: Api, runners) -> None:
        conn = await Conn.open(api.cfg.router.port)
        status, headers, _ = await conn.request("GET", "/health/live")
        assert status == 200 and "connection" not in headers
        assert await conn.closed_by_server(timeout=30)

    assert parse_config({}).router.keepalive_timeout_s == 75
    serve(tmp_path, test, keepalive_timeout_s=0.2)


def test_keep_alive_header_announces_a_timeout_below_the_real_one(tmp_path):
    """``Keep-Alive: timeout=N`` on every kept-alive response (public app, admin app, errors too),
    N below ``keepalive_timeout_s``; a request sent after N idle seconds is still served on that
    connection; a response that closes its connection does not carry it."""

    async def test(api: Api, runners) -> None:
        conn = await Conn.open(api.cfg.router.port)
        for path in ("/health/live", "/v1/models", "/no/such/path"):
            status, headers, _ = await conn.request("GET", path)
            assert headers["keep-alive"] == "timeout=2", (path, status, headers)
        admin = await Conn.open(api.cfg.router.admin_port)
        assert (await admin.request("GET", "/admin/workers"))[1]["keep-alive"] == "timeout=2"
        await asyncio.sleep(2)  # idle for the announced timeout: the server has not closed it yet
        status, headers, _ = await conn.request("GET", "/health/live")
        assert status == 200 and headers["keep-alive"] == "timeout=2"
        status, _, _ = await admin.request("POST", "/admin/shutdown?grace=0")
        status, headers, _ = await conn.request("GET", "/health/live")
        assert headers["connection"].lower() == "close" and "keep-alive" not in headers
        admin.close()

    assert keep_alive_seconds(75) == 67 and keep_alive_seconds(5) == 4 and keep_alive_seconds(0.2) == 1
    serve(tmp_path, test, keepalive_timeout_s=3.5)


def test_connections_past_the_cap_get_503_and_are_closed(tmp_path):
    async def test(api: Api, runners) -> None:
        server = runners[0].server
        first, second = await Conn.open(api.cfg.router.port), await Conn.open(api.cfg.router.port)
        for conn in (first, second):
            assert (await conn.request("GET", "/v1/models"))[0] == 200
        third = await Conn.open(api.cfg.router.port)
        status, headers, body = await third.request("GET", "/v1/models")
        assert status == 503 and headers["retry-after"] == "1" and headers["connection"].lower() == "close"
        error = json.loads(body)["error"]
        assert error["code"] == "too_many_connections" and "router.max_connections" in error["message"]
        assert await third.closed_by_server()
        assert (await second.request("GET", "/v1/models"))[0] == 200  # those within the cap are still served

        live = await Conn.open(api.cfg.router.port)
        assert (await live.request("GET", "/health/live"))[0] == 200  # liveness is never capped
        live.close()
        first.close()
        await wait_for_async(lambda: len(server.connections) == 1, 10, what="only the second connection left")
        fourth = await Conn.open(api.cfg.router.port)
        status, headers, _ = await fourth.request("GET", "/v1/models")
        assert status == 200 and "connection" not in headers
        for conn in (second, fourth):
            conn.close()

    serve(tmp_path, test, max_connections=2)
