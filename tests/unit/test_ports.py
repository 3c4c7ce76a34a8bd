"""Port checks of ``up`` and ``doctor``: a port something already listens on is named by its key."""

from __future__ import annotations

import socket

from launcher.config import parse_config
from launcher.plan.ports import port_problems
from tests.helpers.deployment import free_port


def test_a_taken_port_is_named_by_its_key_and_a_free_one_passes():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy, free = taken.getsockname()[1], free_port()
        cfg = parse_config({"router": {"port": busy, "admin_port": free}})
        (_, port, key, problem), (_, admin_port, admin_key, admin_problem) = port_problems(cfg)
    assert (port, key, admin_port, admin_key) == (busy, "router.port", free, "router.admin_port")
    assert problem is not None and problem.startswith(f"router.port: cannot listen on 127.0.0.1:{busy}")
    assert admin_problem is None
