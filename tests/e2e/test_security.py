"""Access control, listeners, request timeouts and JSON logs on the session's keyed deployment
(``tests/helpers/keyed.py``: one replica, API keys from the environment overriding the file's, an
admin token, a short ``router.request_timeout_s`` and ``--log-format json`` on the command line).
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import time

import httpx
import psutil
import pytest

from tests.helpers.deployment import MODEL, assert_openai_error, wait_for
from tests.helpers.keyed import ADMIN_TOKEN, ENV_KEYS, FILE_KEY, TIMEOUT_S


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Bearer {FILE_KEY}"},
        {"Authorization": "Bearer"},
        {"Authorization": f"Basic {ENV_KEYS[0]}"},
        {"Authorization": f"Bearer {ENV_KEYS[0]}x"},
    ],
    ids=["none", "wrong", "file-key-overridden-by-env", "empty", "basic-scheme", "prefix-of-key"],
)
def test_api_key_required(secured, headers):
    for method, path in (
        ("GET", "/v1/models"),
        ("GET", "/workers"),
        ("GET", "/metrics"),
        ("GET", "/openapi.json"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
    ):
        r = httpx.request(method, f"{secured.url}{path}", headers=headers, json={"prompt": "x"}, timeout=10)
        err = assert_openai_error(r, "invalid_api_key", status=401)
        assert err["type"] == "authentication_error" and "Authorization: Bearer" in err["message"]
        assert r.headers["WWW-Authenticate"].startswith("Bearer")


def test_each_environment_key_works_and_health_is_open(secured):
    for key in ENV_KEYS:
        r = httpx.get(f"{secured.base_url}/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL
    for path in ("/health", "/health/ready", "/health/live"):
        assert httpx.get(f"{secured.url}{path}", timeout=10).status_code == 200
    r = httpx.post(
        f"{secured.base_url}/chat/completions",
        headers=secured.auth_headers(),
        timeout=60,
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert r.status_code == 200, r.text
    doc = httpx.get(f"{secured.url}/openapi.json", headers=secured.auth_headers(), timeout=10).json()
    assert doc["security"] == [{"bearer": []}] and "env-key" not in json.dumps(doc)


def test_admin_api_has_its_own_token(secured):
    url = f"{secured.admin_url}/admin/workers"
    assert_openai_error(httpx.get(url, timeout=10), "invalid_api_key", status=401)
    assert_openai_error(
        httpx.get(url, headers=secured.auth_headers(), timeout=10), status=401
    )  # an API key is not enough
    ok = httpx.get(url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10)
    assert ok.status_code == 200 and ok.json()["workers"][0]["state"] == "ready"
    # The public port does not serve the admin API, whatever the credentials.
    r = httpx.post(f"{secured.url}/admin/shutdown", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10)
    assert r.status_code in (401, 404)
    m = httpx.get(f"{secured.admin_url}/metrics", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10)
    assert m.status_code == 200 and "llamadeploy_worker_state" in m.text


def test_listeners_are_loopback_and_workers_listen_nowhere(secured):
    procs = secured.processes()
    (router,) = procs["router"]
    listening = [c.laddr for c in router.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert {a.port for a in listening} == {secured.port, secured.admin_port}
    assert all(a.ip == "127.0.0.1" for a in listening), listening
    for worker in procs["workers"]:
        assert not [c for c in worker.net_connections(kind="all") if c.status == psutil.CONN_LISTEN]
    address = router.cmdline()[router.cmdline().index("--address") + 1]
    assert address.startswith("ipc://")
    run_dir = os.path.dirname(address.removeprefix("ipc://"))
    assert stat.S_IMODE(os.stat(run_dir).st_mode) & 0o077 == 0  # only our user can reach the socket


def test_no_secret_reaches_a_worker(secured):
    for worker in secured.processes()["workers"]:
        argv = worker.cmdline()
        settings = open(argv[argv.index("--config") + 1]).read()
        secrets = [*ENV_KEYS, FILE_KEY, ADMIN_TOKEN]
        assert not [s for s in secrets if s in settings or s in " ".join(argv) or s in str(worker.environ())]
        assert "api_keys" not in settings and "admin_token" not in settings


def test_request_id_is_echoed_and_logged_by_router_and_worker(secured):
    rid = "sec-test-0001"
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2}
    r = httpx.post(
        f"{secured.base_url}/chat/completions",
        json=body,
        timeout=60,
        headers={**secured.auth_headers(), "X-Request-ID": rid},
    )
    assert r.status_code == 200 and r.headers["X-Request-ID"] == rid
    with httpx.stream(
        "POST",
        f"{secured.base_url}/chat/completions",
        json={**body, "stream": True},
        timeout=60,
        headers={**secured.auth_headers(), "X-Request-ID": rid + "-s"},
    ) as s:
        assert s.status_code == 200 and s.headers["X-Request-ID"] == rid + "-s"
        assert s.read().rstrip().endswith(b"data: [DONE]")
    for bad in ("has spaces", "x" * 129, "é".encode(), "a;b=c"):
        r = httpx.get(f"{secured.base_url}/models", headers={**secured.auth_headers(), "X-Request-ID": bad}, timeout=10)
        assert re.fullmatch(r"[0-9a-f]{32}", r.headers["X-Request-ID"])
    r = httpx.get(f"{secured.base_url}/models", headers={"X-Request-ID": "unauth-1"}, timeout=10)
    assert r.status_code == 401 and r.headers["X-Request-ID"] == "unauth-1"

    def roles() -> set[str]:
        entries = [json.loads(line) for line in secured.log().splitlines() if f'"{rid}"' in line]
        return {e["role"].split()[0] for e in entries if e.get("request_id") == rid}

    wait_for(lambda: {"router", "worker-0"} <= roles(), 10, what=f"router and worker-0 log lines of {rid}")


def test_request_timeout_is_a_504_naming_the_limit(secured):
    started = time.monotonic()
    r = httpx.post(
        f"{secured.base_url}/chat/completions",
        headers=secured.auth_headers(),
        timeout=60,
        json={"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 2000, "ignore_eos": True},
    )
    err = assert_openai_error(r, "timeout", status=504)
    assert "router.request_timeout_s" in err["message"]
    assert time.monotonic() - started < TIMEOUT_S + 10
    wait_for(
        lambda: not any(w["in_flight"] or w["running"] for w in secured.workers()),
        20,
        what="the timed-out request cancelled on the worker",
    )


def test_a_body_that_never_arrives_is_a_408(secured):
    with socket.create_connection(("127.0.0.1", secured.port), timeout=TIMEOUT_S + 10) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + ENV_KEYS[0].encode() + b'\r\nContent-Length: 1000\r\n\r\n{"messages"'
        )
        started = time.monotonic()
        reply = s.recv(65536)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"router.request_timeout_s" in reply and time.monotonic() - started < TIMEOUT_S + 5
    assert httpx.get(f"{secured.url}/health", timeout=10).status_code == 200


def test_logs_are_one_json_object_per_line(secured):
    lines = [line for line in secured.log().splitlines() if line.strip()]
    assert len(lines) > 10
    roles = set()
    for line in lines:
        entry = json.loads(line)  # raises on any line that is not one JSON object
        assert {"ts", "level", "role", "logger", "msg"} <= set(entry), line
        roles.add(entry["role"].split()[0])
    assert {"launcher", "router", "worker-0"} <= roles
    assert not any(k in secured.log() for k in (*ENV_KEYS, ADMIN_TOKEN))  # no secret is ever logged
