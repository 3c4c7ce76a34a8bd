"""``doctor``'s port rows: a port held by this same deployment (a router there answers
``/health/live`` with this file's deployment id) is ``ok``, "in use by this deployment"; one
held by anything else (another deployment, not a router at all) fails as before."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from launcher.config import DeployConfig
from launcher.plan.doctor import port_checks
from router.settings import deployment_id


@pytest.fixture
def stand_in():
    """A loopback HTTP server answering every GET with its ``answer`` dict (a router's stand-in)."""
    answer: dict = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], answer
    server.shutdown()
    server.server_close()


def public_row(cfg: DeployConfig):
    return next(r for r in port_checks(cfg) if r.name == "router.port")


def test_a_port_held_by_this_deployment_is_in_use_by_this_deployment(stand_in):
    port, answer = stand_in
    cfg = DeployConfig.model_validate({"router": {"port": port}})
    answer.update(status="ok", deployment=deployment_id(cfg.router, [cfg.model.public_name]))
    row = public_row(cfg)
    assert row.status == "ok" and "in use by this deployment" in row.detail, row


@pytest.mark.parametrize("said", [{"status": "ok", "deployment": "0123456789ab"}, {"status": "ok"}])
def test_a_port_held_by_anything_else_fails(stand_in, said):
    port, answer = stand_in
    answer.update(said)
    row = public_row(DeployConfig.model_validate({"router": {"port": port}}))
    assert row.status == "fail" and "cannot listen" in row.detail, row


def test_the_id_changes_with_the_addresses_and_the_models():
    cfg = DeployConfig()
    base = deployment_id(cfg.router, ["m"])
    assert base == deployment_id(cfg.router, ["m"]) and len(base) == 12
    assert base != deployment_id(cfg.router, ["other"])
    moved = DeployConfig.model_validate({"router": {"port": 9000}})
    assert base != deployment_id(moved.router, ["m"])
