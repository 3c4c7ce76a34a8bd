"""The router's listening addresses and whether they can be bound now (``up`` and ``doctor``), and a free
port for a rendezvous or a test server."""

from __future__ import annotations

import socket

from launcher.config import DeployConfig


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now (the kernel's pick), for a
    rendezvous or a test server; another process may take it before it is bound again."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def listen_addresses(cfg: DeployConfig) -> list[tuple[str, int, str]]:
    """``(host, port, config key)`` of every address the router listens on: public, then admin."""
    r = cfg.router
    return [(r.host, r.port, "router.port"), (r.admin_host, r.admin_port, "router.admin_port")]


def port_problem(host: str, port: int, key: str) -> str | None:
    """None if ``host:port`` can be bound now, else a message naming the config ``key``.

    Binds with ``SO_REUSEADDR`` as the router does, so a port held only by connections in
    TIME_WAIT counts as free.
    """
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return f"{key}: cannot listen on {host}:{port} ({exc.strerror}); stop what uses it or choose another port"
    return None


def port_problems(cfg: DeployConfig) -> list[tuple[str, int, str, str | None]]:
    """``(host, port, key, problem or None)`` for each of :func:`listen_addresses`."""
    return [(host, port, key, port_problem(host, port, key)) for host, port, key in listen_addresses(cfg)]
