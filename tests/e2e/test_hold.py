"""The smallest deployment (one CPU replica) loses no request while its only worker is replaced:
requests wait for it (router.hold) instead of 503 — a ``kill -9``, ``restart-worker`` and a
rolling ``apply`` of ``max_num_seqs``, each under 4 streaming clients plus a non-streaming loop.

Each test prints how long requests were held (``llamadeploy_request_hold_seconds``) against the
replacement's load time: a benchmark figure, never asserted.
"""

from __future__ import annotations

import os
import re
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers.deployment import MODEL, Deployment, cli, wait_for
from tests.helpers.steady_load import SteadyLoad

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def solo(tmp_path_factory):
    """One replica (what most users run); short prompts and answers keep the loops quick."""
    d = Deployment(
        tmp_path_factory.mktemp("hold"),
        {
            "model": {"max_model_len": 512},
            "workers": {"replicas": 1, "max_num_seqs": 4, "kv_cache_gib": 0.05},
            "router": {"request_timeout_s": 300, "hold_s": 240},
            "limits": {"max_tokens": 16},
        },
    )
    d.start()
    yield d
    d.stop()


class RequestLoop:
    """One client sending non-streaming chats one after another, counting statuses."""

    def __init__(self, d: Deployment):
        self.d, self.statuses, self.errors = d, {}, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RequestLoop:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=300)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                r = self.d.chat("Say hi.", max_tokens=4, timeout=300)
                self.statuses[r.status_code] = self.statuses.get(r.status_code, 0) + 1
                if r.status_code != 200:
                    self.errors.append(r.text[:200])
            except httpx.HTTPError as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")


def held(d: Deployment) -> tuple[float, float]:
    """(requests held and dispatched, seconds held in all) from /metrics."""
    text = httpx.get(f"{d.url}/metrics", timeout=10).text
    count = sum(float(v) for v in re.findall(r'request_hold_seconds_count\{[^}]*outcome="dispatched"\} (\S+)', text))
    total = sum(float(v) for v in re.findall(r'request_hold_seconds_sum\{[^}]*outcome="dispatched"\} (\S+)', text))
    return count, total


def replaced_under_load(d: Deployment, replace) -> dict:
    """Run ``replace()`` (which returns once the worker is replaced) under 4 streaming clients and a
    non-streaming loop; assert nothing failed; return the worker table's only row afterwards."""
    count0, total0 = held(d)
    with SteadyLoad(d.base_url, MODEL, clients=4, max_tokens=8, timeout=400) as clients, RequestLoop(d) as loop:
        clients.wait_completed(4, timeout=400)  # on a loaded 2-core box one stream may take a minute
        replace()
        wait_for(lambda: d.workers()[0]["state"] == "ready", 400, "the replacement ready")
        clients.wait_completed(4, timeout=400)
        counts = clients.stop()
    assert counts.failed == 0 and counts.server_errors == 0, (counts.failures, counts.statuses)
    assert set(loop.statuses) == {200} and not loop.errors, (loop.statuses, loop.errors[:3])
    (worker,) = d.workers()
    count, total = held(d)
    print(
        f"\nheld {count - count0:.0f} requests, {total - total0:.1f}s in all; replacement loaded in "
        f"{worker['load_seconds']:.1f}s"
    )
    return worker


def test_kill9_of_the_only_worker_holds_requests_until_it_is_back(solo):
    (before,) = solo.workers()
    arrivals = ThreadPoolExecutor(3)
    late: list = []

    def kill():
        os.kill(before["pid"], signal.SIGKILL)
        # while it reloads the model is "loading": not ready, yet new requests wait rather than fail
        wait_for(lambda: httpx.get(f"{solo.url}/health/ready").status_code == 503, 30, "/health/ready 503")
        models = httpx.get(f"{solo.base_url}/models", timeout=10).json()["data"]
        late.extend(arrivals.submit(solo.chat, f"Say {n}.", max_tokens=2, timeout=400) for n in range(3))
        assert [m["state"] for m in models] in (["loading"], ["ready"]), models

    after = replaced_under_load(solo, kill)
    assert [f.result().status_code for f in late] == [200] * 3, [f.result().text for f in late]
    arrivals.shutdown()
    assert after["pid"] != before["pid"] and after["restarts"] == before["restarts"] + 1
    assert held(solo)[0] >= 3  # the requests that arrived while no replica was ready were held
    assert httpx.get(f"{solo.url}/health/ready?model={MODEL}").status_code == 200
    assert httpx.get(f"{solo.url}/health/ready?model=nope").status_code == 404


def test_restart_worker_of_the_only_worker_loses_no_request(solo):
    (before,) = solo.workers()

    def restart():
        done = cli("restart-worker", "0", "--drain", "--config", str(solo.path), timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr

    after = replaced_under_load(solo, restart)
    assert after["pid"] != before["pid"]


def test_apply_of_max_num_seqs_on_the_only_replica_loses_no_request(solo):
    """On 2 cores there is no spare core set: the new worker loads on the old one's cores while it
    serves, then the old one drains (a surge)."""
    (before,) = solo.workers()
    out: list = []

    def apply():
        done = solo.apply({"workers": {"max_num_seqs": 3}})
        out.append(done)
        assert done.returncode == 0, done.stdout + done.stderr

    after = replaced_under_load(solo, apply)
    assert "surge" in out[0].stdout, out[0].stdout
    assert after["max_num_seqs"] == 3 and after["pid"] != before["pid"]
