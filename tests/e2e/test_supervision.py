"""Supervision and operations, end to end (real model, 2 CPU workers).

The tests on ``sup`` share one deployment, each leaving both workers ready again: kill -9 during
non-streaming and streaming requests, restart-worker --drain under load, a request timeout, a hung
(SIGSTOPped) worker; the module's last test ends it with SIGTERM. ``crashing`` is a deployment
whose worker 1 crashes at every start; the stall and fail-fast tests start their own.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers.deployment import (
    MODEL,
    STANDBY,
    Deployment,
    alive,
    all_ready_and_idle,
    assert_openai_error,
    cli,
    wait_for,
)

FAULT = "LLAMADEPLOY_FAULT_CRASH_AT_START"
STALL = "LLAMADEPLOY_FAULT_STALL"


def long_chat(d: Deployment, i: int, max_tokens: int, **kw) -> httpx.Response:
    return d.chat(f"Tell me story number {i}.", max_tokens=max_tokens, ignore_eos=True, timeout=180, **kw)


def stream_events(
    d: Deployment, body: dict, first_text: threading.Event | None = None, headers: dict | None = None
) -> list:
    """Every ``data:`` payload of one SSE response (JSON decoded, except ``[DONE]``)."""
    events: list = []
    with httpx.stream(
        "POST", f"{d.base_url}/chat/completions", json={"model": MODEL, **body}, timeout=180, headers=headers or {}
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[6:]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
            choices = events[-1]["choices"] if isinstance(events[-1], dict) and events[-1].get("choices") else []
            if first_text is not None and choices and choices[0]["delta"].get("content"):
                first_text.set()
    return events


@pytest.fixture(scope="module")
def sup(tmp_path_factory):
    # Failover without migration (what a stream that cannot migrate gets); tests/e2e/test_migration.py
    # covers migration.
    d = Deployment(
        tmp_path_factory.mktemp("supervision"),
        {"workers": {"heartbeat_timeout_s": 5}, "router": {"max_migrations": 0}, **STANDBY},
    )
    d.start()
    yield d
    assert d.stop() == 0, d.log()[-3000:]


# ---- 1. kill -9 during 16 non-streaming requests ----------------------------------------


def test_kill9_during_nonstreaming_requests_loses_none(sup):
    victim = sup.worker(0)
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(long_chat, sup, i, 48) for i in range(16)]
        wait_for(lambda: sup.worker(0)["running"] >= 4, 30, "worker 0 to be decoding")
        time.sleep(1.0)  # tokens are flowing: the retry must start over, not resume
        os.kill(victim["pid"], signal.SIGKILL)
        results = [f.result() for f in futures]
    assert [r.status_code for r in results] == [200] * 16, [r.text for r in results if r.status_code != 200]
    assert all(r.json()["usage"]["completion_tokens"] == 48 for r in results)
    w0 = wait_for(
        lambda: (w := sup.worker(0))["state"] == "ready" and w["pid"] != victim["pid"] and w,
        90,
        "worker 0 to come back",
    )
    assert w0["restarts"] == 1, w0
    assert "SIGKILL" in w0["exit_reason"]
    assert sup.worker(1)["restarts"] == 0
    wait_for(lambda: all_ready_and_idle(sup), 10, "in-flight counts to return to 0")
    assert f"worker 0 (pid {victim['pid']}) killed by SIGKILL; restarting" in sup.log()


# ---- 2. kill -9 during streams ------------------------------------------------------------


def test_kill9_ends_started_streams_with_error_and_done(sup):
    wait_for(lambda: all_ready_and_idle(sup), 30, "both workers ready")
    victim = sup.worker(1)
    served0 = sup.worker(0)["served"]
    started = [threading.Event() for _ in range(4)]
    body = {
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 100,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(stream_events, sup, body, started[i]) for i in range(4)]
        wait_for(lambda: all(e.is_set() for e in started), 60, "every stream to have sent text")
        on_victim = sup.worker(1)["in_flight"]
        os.kill(victim["pid"], signal.SIGKILL)
        after = [sup.chat("Say hi.", max_tokens=4) for _ in range(3)]  # arrive after the kill
        streams = [f.result() for f in futures]  # never hangs: each ends with [DONE]
    assert [r.status_code for r in after] == [200] * 3
    assert all(s[-1] == "[DONE]" for s in streams)
    failed = [s for s in streams if "error" in s[-2]]
    for s in failed:
        assert_openai_error(s[-2], "worker_lost")
        assert s[-2]["error"]["type"] == "server_error"
    finished = [s for s in streams if "error" not in s[-2]]
    assert all(s[-2]["choices"][0]["finish_reason"] == "length" for s in finished)
    assert len(failed) == on_victim >= 1
    w1 = wait_for(
        lambda: (w := sup.worker(1))["state"] == "ready" and w["pid"] != victim["pid"] and w,
        90,
        "worker 1 to come back",
    )
    assert w1["restarts"] == victim["restarts"] + 1
    assert w1["served"] == victim["served"]  # nothing after the kill went to the dead worker
    assert sup.worker(0)["served"] == served0 + len(finished) + 3
    wait_for(lambda: all_ready_and_idle(sup), 10, "in-flight counts to return to 0")


# ---- 3. restart-worker --drain under steady load ----------------------------------------


def test_restart_worker_drain_under_load_drops_nothing(sup):
    wait_for(lambda: all_ready_and_idle(sup), 30, "both workers ready")
    before = sup.worker(0)
    stop = threading.Event()
    statuses: list[int] = []

    def client(k: int) -> None:
        n = 0
        while not stop.is_set():
            statuses.append(sup.chat(f"Count to {k + n}.", max_tokens=16, timeout=120).status_code)
            n += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    try:
        time.sleep(2)
        restarted = cli("restart-worker", "0", "--drain", "--config", str(sup.path), timeout=180)
        time.sleep(1)  # some load on the restarted worker too
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert restarted.returncode == 0, restarted.stdout + restarted.stderr
    assert "worker 0 ready" in restarted.stdout + restarted.stderr
    assert len(statuses) >= 10 and set(statuses) == {200}, statuses
    w0 = sup.worker(0)
    assert w0["state"] == "ready" and w0["pid"] != before["pid"] and w0["restarts"] == before["restarts"] + 1
    assert w0["failed_requests"] == before["failed_requests"]
    wait_for(lambda: all_ready_and_idle(sup), 10, "in-flight counts to return to 0")


# ---- 6. per-request timeout ------------------------------------------------------------------


def test_request_timeout_gives_504_and_cancels_on_the_worker(sup):
    wait_for(lambda: all_ready_and_idle(sup), 30, "both workers ready")
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a very long story."}],
        "max_tokens": 1500,
        "ignore_eos": True,
    }
    t0 = time.monotonic()
    r = httpx.post(f"{sup.base_url}/chat/completions", json=body, headers={"X-Request-Timeout": "2"}, timeout=60)
    assert r.status_code == 504, r.text
    assert time.monotonic() - t0 < 10
    assert_openai_error(r.json(), "timeout")
    events = stream_events(sup, {**body, "stream": True}, headers={"X-Request-Timeout": "2"})
    assert events[-1] == "[DONE]"
    assert_openai_error(events[-2], "timeout")
    wait_for(lambda: all_ready_and_idle(sup), 10, "in-flight and running counts to return to 0")
    bad = httpx.post(f"{sup.base_url}/chat/completions", json=body, headers={"X-Request-Timeout": "soon"}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Request-Timeout"


# ---- heartbeat fallback: a hung worker -----------------------------------------------------


def test_hung_worker_is_declared_dead_killed_and_restarted(sup):
    wait_for(lambda: all_ready_and_idle(sup), 30, "both workers ready")
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(long_chat, sup, 0, 60)
        busy = wait_for(lambda: next((w for w in sup.workers() if w["in_flight"]), None), 10, "a busy worker")
        os.kill(busy["pid"], signal.SIGSTOP)  # alive, but silent
        try:
            r = future.result()
        finally:
            if alive(busy["pid"]):
                os.kill(busy["pid"], signal.SIGCONT)
    assert r.status_code == 200, r.text  # retried on the other worker after the missed heartbeats
    back = wait_for(
        lambda: (w := sup.worker(busy["id"]))["state"] == "ready" and w["pid"] != busy["pid"] and w,
        90,
        "the hung worker to be replaced",
    )
    assert back["restarts"] == busy["restarts"] + 1
    assert "no heartbeat" in back["exit_reason"] and "SIGKILL" in back["exit_reason"]
    assert not alive(busy["pid"])


# ---- the router is supervised too -----------------------------------------------------------


def ready_status(d: Deployment) -> int:
    try:
        return httpx.get(f"{d.url}/health/ready", timeout=2).status_code
    except httpx.HTTPError:
        return 0  # the router is down


def test_kill9_of_the_router_under_load_restarts_it_and_the_workers_rejoin_unchanged(sup):
    wait_for(lambda: all_ready_and_idle(sup), 30, "both workers ready")
    workers = {w["id"]: (w["pid"], w["restarts"]) for w in sup.workers()}
    router = sup.admin("GET", "/admin/workers").json()["router"]
    created = [m["created"] for m in httpx.get(f"{sup.base_url}/models", timeout=10).json()["data"]]
    events_before = httpx.get(f"{sup.url}/activity", timeout=10).json()["events"]
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(long_chat, sup, i, 200) for i in range(4)]
        wait_for(lambda: sum(w["running"] for w in sup.workers()) >= 2, 30, "requests decoding")
        os.kill(router["pid"], signal.SIGKILL)
        lost = [f.exception() for f in futures]  # their connections died with the router
    assert all(isinstance(e, httpx.HTTPError) for e in lost), lost
    wait_for(lambda: ready_status(sup) == 200, 10, "/health/ready to answer 200 again")
    assert sup.proc.poll() is None  # `up` keeps running
    assert sup.chat("Say hi.", max_tokens=4).status_code == 200
    # The same processes (not restarted) rejoin; their restart counts come from the supervisor's
    # reports, which may reach the new router a moment after the workers' own Hello.
    wait_for(
        lambda: (
            all(w["state"] == "ready" for w in sup.workers())
            and {w["id"]: (w["pid"], w["restarts"]) for w in sup.workers()} == workers
        ),
        10,
        "every worker to re-register, unchanged",
    )
    new = sup.admin("GET", "/admin/workers").json()["router"]
    assert new["pid"] != router["pid"] and new["restarts"] == router["restarts"] + 1
    status = cli("status", str(sup.path))
    assert status.returncode == 0 and f"restarts {new['restarts']}" in status.stdout, status.stdout
    assert f"router (pid {router['pid']}) killed by SIGKILL; restarting" in sup.log()
    wait_for(lambda: all_ready_and_idle(sup), 30, "the lost requests to be cancelled on the workers")
    # what the deployment, not the router process, holds: the models' start and the status page's events
    assert [m["created"] for m in httpx.get(f"{sup.base_url}/models", timeout=10).json()["data"]] == created
    assert created[0] > 1_700_000_000
    events = httpx.get(f"{sup.url}/activity", timeout=10).json()["events"]
    newest = events_before[:5]  # the page shows the last 60: the oldest may have scrolled out since
    assert newest and all(e in events for e in newest), (newest, events)
    (marker,) = [e for e in events if e["kind"] == "router"]
    assert marker["worker_id"] == -1 and f"restart {new['restarts']}" in marker["detail"]


# ---- hung, not dead: an engine loop that stops stepping --------------------------------------


def test_a_stalled_engine_is_declared_dead_its_request_moves_and_it_is_restarted(tmp_path):
    d = Deployment(tmp_path, {"workers": {"stall_timeout_s": 3}}, env={STALL: "1"}).start()
    try:
        # the first heartbeats after Ready carry the engine's step counter
        victim = wait_for(lambda: (w := d.worker(1))["steps"] is not None and w, 15, "worker 1 to report its steps")
        with ThreadPoolExecutor(2) as pool:  # least_loaded: one request on each worker
            results = list(pool.map(lambda i: long_chat(d, i, 24), range(2)))
        assert [r.status_code for r in results] == [200, 200], [r.text for r in results]
        assert all(r.json()["usage"]["completion_tokens"] == 24 for r in results)
        back = wait_for(
            lambda: (w := d.worker(1))["pid"] != victim["pid"] and w["state"] == "ready" and w,
            120,
            "the stalled worker to be replaced",
        )
        assert "stalled: no engine step" in back["exit_reason"] and "SIGKILL" in back["exit_reason"], back
        assert back["restarts"] == 1 and d.worker(0)["restarts"] == 0
        assert f"{STALL} names this worker" in d.log()
    finally:
        d.stop()


# ---- 4. a worker that crashes at every start ---------------------------------------------


@pytest.fixture(scope="module")
def crashing(tmp_path_factory):
    d = Deployment(
        tmp_path_factory.mktemp("crashing"),
        {"supervisor": {"max_restarts": 2, "restart_backoff_s": 0.2}},
        env={FAULT: "1"},
    )
    d.health_seen = []

    def wait_ready(timeout: float = 240.0, count: int | None = None) -> None:
        """Record /health while the workers load, then wait for worker 0 alone."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and d.proc.poll() is None:
            try:
                live, ready = (httpx.get(f"{d.url}/health/{k}", timeout=5).status_code for k in ("live", "ready"))
                states = [w["state"] for w in d.workers()]
            except httpx.HTTPError:
                time.sleep(0.1)
                continue
            d.health_seen.append((live, ready, states))
            if "ready" in states:
                break
            time.sleep(0.1)
        Deployment.wait_ready(d, timeout, count=1)

    d.wait_ready = wait_ready
    d.start()
    yield d
    d.stop()


def test_crash_at_start_ends_failed_and_service_keeps_serving(crashing):
    d = crashing
    assert any(live == 200 and ready == 503 for live, ready, _ in d.health_seen), d.health_seen
    assert all("ready" in states for _, ready, states in d.health_seen if ready == 200), d.health_seen
    w1 = wait_for(lambda: (w := d.worker(1))["state"] == "failed" and w, 60, "worker 1 to be marked failed")
    assert w1["restarts"] == 2 and w1["exit_reason"] == "exit code 3", w1
    assert d.log().count("worker 1 (pid") == 3  # 1 start + max_restarts restarts, each exit logged
    assert "marked failed" in d.log()
    wait_for(lambda: "1 of 2 workers, failed: 1" in d.log(), 10, "the launcher's ready line")
    for _ in range(3):
        assert d.chat("Say hi.", max_tokens=4).status_code == 200
    assert d.worker(0)["served"] == 3
    assert httpx.get(f"{d.url}/health/ready").status_code == 200
    status = cli("status", str(d.path))
    assert status.returncode == 0 and "failed" in status.stdout and "exit code 3" in status.stdout, status.stdout
    # An operator adds the capacity back: the crash history is cleared and it gets K tries again.
    r = d.admin("POST", "/admin/workers/1/start")
    assert r.status_code == 200 and r.json()["action"] == "starting", r.text
    w1 = wait_for(
        lambda: (w := d.worker(1))["state"] == "failed" and w["restarts"] == 5 and w,
        60,
        "worker 1 to fail again after 3 more tries",
    )
    assert d.worker(0)["state"] == "ready"


def test_kill9_of_the_launcher_leaves_no_process(crashing):
    d = crashing
    children = d.child_pids()
    assert len(children) >= 2  # router and worker 0
    os.kill(d.proc.pid, signal.SIGKILL)
    d.proc.wait(timeout=10)
    wait_for(lambda: not any(alive(p) for p in children), 10, "the router and workers to die with the launcher")


def test_every_worker_crashing_at_start_fails_fast(tmp_path):
    d = Deployment(tmp_path, env={FAULT: "all"})
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with 1"):
        d.start(timeout=60)
    assert time.monotonic() - t0 < 45
    assert "every worker exited during start-up" in d.log()
    assert d.stop() == 1


# ---- 5. graceful shutdown on SIGTERM -----------------------------------------------------------


def test_sigterm_finishes_in_flight_refuses_new_and_exits_0(sup):
    """The module's last test: it ends ``sup`` (whose teardown then finds it exited with 0)."""
    d = sup
    wait_for(lambda: all_ready_and_idle(d), 120, "both workers ready and idle")
    children = d.child_pids()
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(long_chat, d, i, 64) for i in range(8)]
        wait_for(lambda: sum(w["running"] for w in d.workers()) == 8, 30, "8 requests decoding")
        d.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(f"{d.url}/health/ready").status_code == 503, 10, "/health/ready to say 503")
        refused = d.chat("Say hi.", max_tokens=4)
        assert httpx.get(f"{d.url}/health/live").status_code == 200
        results = [f.result() for f in futures]
    assert refused.status_code == 503, refused.text
    assert_openai_error(refused.json(), "no_ready_worker")
    assert [r.status_code for r in results] == [200] * 8, [r.text for r in results]
    assert d.proc.wait(timeout=60) == 0, d.log()[-3000:]
    assert not any(alive(p) for p in children), children
