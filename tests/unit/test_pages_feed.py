"""What the status page reads: the router's activity buckets, its worker event log, and which
paths the pages open without an API key."""

from __future__ import annotations

import asyncio

import pytest

from router.activity import Activity
from router.admin_protocol import WorkerState as S
from router.events import EventLog
from router.ui import PAGES_DIR, is_open


class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_activity_buckets_rates_and_ttft():
    clock = Clock(1000.0)
    a = Activity(bucket_s=2.0, span_s=10.0, clock=clock)
    a.first_token(0.2)
    a.first_token(0.4)
    a.tokens(10)
    clock.t = 1002.5  # the next bucket, half of it elapsed
    a.tokens(3)
    a.finished()
    h = a.history()
    assert h["bucket_s"] == 2.0 and len(h["buckets"]) == 5
    older, newest = h["buckets"][-2], h["buckets"][-1]
    assert older == {
        "t": 1000.0,
        "tokens_per_s": 5.0,
        "requests_per_s": 0.0,
        "first_tokens": 2,
        "ttft_mean_s": pytest.approx(0.3),
        "ttft_max_s": 0.4,
    }
    assert newest["tokens_per_s"] == 6.0 and newest["requests_per_s"] == 2.0  # over its 0.5 s so far
    assert newest["ttft_mean_s"] is None and newest["first_tokens"] == 0
    assert [b["t"] for b in h["buckets"]] == [994.0, 996.0, 998.0, 1000.0, 1002.0]


def test_activity_forgets_what_is_older_than_its_span():
    clock = Clock(0.0)
    a = Activity(bucket_s=1.0, span_s=3.0, clock=clock)
    a.tokens(7)
    clock.t = 10.0
    assert all(b["tokens_per_s"] == 0 for b in a.history()["buckets"])
    assert len(a._buckets) == 1  # the ring holds at most span/bucket buckets


def test_event_log_names_what_happened_and_why():
    log = EventLog(size=4)
    log.process_started(0, pid=11, restarts=0)
    log.state_changed(0, S.STARTING, S.READY, load_seconds=3.25)
    log.state_changed(0, S.READY, S.DEAD, "killed by SIGKILL")
    log.process_started(0, pid=12, restarts=1)
    log.migrated(0, 1, tokens=37, why="worker 0 was lost (killed by SIGKILL)")
    events = log.recent()
    assert [e["kind"] for e in events] == ["migrated", "restarted", "died", "ready"]  # newest first, 4 kept
    assert events[0]["detail"] == "a request moved to worker 1 after 37 tokens (worker 0 was lost (killed by SIGKILL))"
    assert events[1]["detail"] == "pid 12, restart 1"
    assert events[2]["detail"] == "killed by SIGKILL"
    assert events[3]["detail"] == "loaded in 3.2s"
    assert [e["seq"] for e in events] == [5, 4, 3, 2]


def test_event_log_drain_and_undrain():
    log = EventLog()
    log.state_changed(1, S.READY, S.DRAINING)
    log.state_changed(1, S.DRAINING, S.READY)
    log.state_changed(1, S.READY, S.STARTING)  # logged from the process start instead
    assert [(e["kind"], e["worker_id"]) for e in log.recent()] == [("undrained", 1), ("draining", 1)]


@pytest.mark.parametrize(
    "path,open_",
    [
        ("/", True),
        ("/status", True),
        ("/pages/chat.js", True),
        ("/favicon.ico", True),
        ("/health/ready", True),
        ("/v1/models", False),
        ("/workers", False),
        ("/activity", False),
        ("/status/admin", False),
        ("/metrics", False),
    ],
)
def test_only_the_pages_and_health_are_open(path, open_):
    assert is_open(path) is open_


def test_the_pages_ship_no_external_reference():
    """Every asset is in the package, and none names another host (no CDN, no web font)."""
    names = {p.name for p in PAGES_DIR.iterdir()}
    assert {"index.html", "status.html", "chat.js", "status.js", "markdown.js", "style.css"} <= names
    for path in PAGES_DIR.iterdir():
        text = path.read_text()
        for word in ("//cdn", "googleapis", "unpkg", "jsdelivr", "@import", "innerHTML", "outerHTML", "eval("):
            assert word not in text, (path.name, word)
        if path.suffix == ".html":  # no inline script (the CSP would block it), no remote URL
            assert "<script>" not in text and "http://" not in text and "https://" not in text, path.name


def test_the_pool_logs_a_death_and_the_migration_it_caused():
    """Fed where it happens: the pool's state change and the generation's move to another worker."""
    from router.generation import stream_tokens
    from tests.helpers.router_pool import PARAMS, collect, run, say, step, two_workers

    async def scenario():
        pool = two_workers()
        task = asyncio.create_task(collect(stream_tokens(pool, [1, 2], PARAMS, max_retries=1, max_migrations=1)))
        await step()
        say(pool, "Hi", [5])
        await step()
        first, _ = pool.generates()[0]
        pool.mark_lost(first, "killed by SIGKILL")
        await step()
        second, _ = pool.generates()[1]
        say(pool, "!", [6], finish="stop", total=2)
        await task
        return pool.events.recent(), first, second

    events, first, second = run(scenario())
    kinds = [(e["kind"], e["worker_id"]) for e in events]
    assert kinds[:2] == [("migrated", first), ("died", first)], kinds
    assert events[0]["detail"].startswith(f"a request moved to worker {second} after 1 tokens")
    assert events[1]["detail"] == "killed by SIGKILL"
