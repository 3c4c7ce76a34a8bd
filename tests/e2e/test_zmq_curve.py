"""A deployment whose workers connect over ``tcp://127.0.0.1`` with CURVE (one replica).

``llamadeploy up`` makes the keys in the run directory; the worker completes the handshake and
serves; the keys are files of mode 0600 in a 0700 folder, named to children only by an
environment variable, and appear in no process's command line; no secret key appears in any log
line (a public key may: it is not a secret, and at debug level the ZAP authenticator names the
client key it let in); a peer without the keys is refused by the live router and changes nothing
in its table.

The deployment is the session's ``curve_busy`` (fixtures.py; debug logs, a small queue), shared
with test_batching; the router restart is the module's last test.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

import openai
import psutil
import pytest
import zmq

from tests.helpers.deployment import MODEL, Deployment, wait_for
from worker.contract.env import KEYS_ENV
from worker.contract.protocol import PROTOCOL_VERSION, Hello, encode, worker_identity


@pytest.fixture(scope="module")
def tcp_deployment(curve_busy):
    """The session's one-replica deployment over tcp with CURVE (``curve_busy`` in fixtures.py)."""
    curve_busy.wait_ready(240)
    return curve_busy


def router_process(d: Deployment) -> psutil.Process:
    (router,) = [
        p
        for p in map(psutil.Process, d.child_pids())
        if "router.main" in p.cmdline() and "--standby" not in p.cmdline()
    ]
    return router


def test_a_tcp_deployment_answers_a_chat_request(tcp_deployment):
    client = openai.OpenAI(base_url=tcp_deployment.base_url, api_key="unused", max_retries=0)
    chat = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=30,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    assert "Paris" in chat.choices[0].message.content
    router = router_process(tcp_deployment)
    assert router.cmdline()[router.cmdline().index("--address") + 1] == tcp_deployment.zmq_address
    assert "with CURVE" in tcp_deployment.log()


def test_keys_are_private_files_on_no_command_line_and_no_secret_in_a_log(tcp_deployment):
    folder = Path(router_process(tcp_deployment).environ()[KEYS_ENV])
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and stat.S_IMODE(folder.parent.stat().st_mode) == 0o700
    files = sorted(folder.iterdir())
    assert {f.name for f in files} == {"router.public", "router.secret", "worker-0.public", "worker-0.secret"}
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    keys = [f.read_text().strip() for f in files]
    assert all(len(k) == 40 for k in keys) and len(set(keys)) == 4  # Z85 of 32 random bytes each
    seen = 0
    for p in psutil.process_iter():
        try:
            with open(f"/proc/{p.pid}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except OSError:
            continue  # gone, or not ours to read
        seen += 1
        assert not any(k in cmdline for k in keys), cmdline
    assert seen > 3  # at least the launcher, router and worker were read
    log = tcp_deployment.log()
    secrets = [f.read_text().strip() for f in files if f.suffix == ".secret"]
    assert len(secrets) == 2 and not any(k in log for k in secrets)


def test_a_peer_without_the_keys_is_refused_and_changes_nothing(tcp_deployment):
    before = tcp_deployment.worker(0)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, worker_identity(0))  # it claims the real worker's slot
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(tcp_deployment.zmq_address)
    hello = Hello(
        protocol=PROTOCOL_VERSION,
        worker_id=0,
        pid=os.getpid(),
        device="cpu[0]",
        model=MODEL,
        max_num_seqs=1,
        max_waiting=0,
    )
    try:
        # Without waiting: once the handshake has failed libzmq drops the DEALER's pipe for good
        # and a waiting send would hang (tests/integration/test_curve.py); the Hello never left.
        with contextlib.suppress(zmq.Again):
            sock.send(encode(hello), flags=zmq.NOBLOCK)
        wait_for(lambda: "refused a ZeroMQ peer" in tcp_deployment.log(), 20, what="the router's refusal in the log")
    finally:
        sock.close()
        ctx.term()
    after = tcp_deployment.worker(0)
    assert (after["pid"], after["state"], after["restarts"]) == (before["pid"], "ready", before["restarts"])
    r = tcp_deployment.chat("What is the capital of France?", max_tokens=10)
    assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"]


def test_a_restarted_router_takes_its_worker_back_over_curve(tcp_deployment):
    before = tcp_deployment.worker(0)
    router_process(tcp_deployment).kill()

    def back() -> bool:
        table = tcp_deployment.admin("GET", "/admin/workers", timeout=5).json()
        (w,) = table["workers"]
        return table["router"]["restarts"] == 1 and w["state"] == "ready" and w["pid"] == before["pid"]

    wait_for(back, 60, interval=0.5, what="the new router with worker 0 registered again, not restarted")
    r = tcp_deployment.chat("What is the capital of France?", max_tokens=10)
    assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"]
