"""The router keeps one record per request attempt (:class:`router.workers.RouterRequest`), held by
the worker that owns it: a worker's in-flight count is its records, events reach the record of the
worker that sent them, and a waiter for a worker wakes on a change instead of polling."""

from __future__ import annotations

import asyncio

from router.workers import State
from tests.helpers.router_pool import RecordingPool, run, step, two_workers
from worker.contract.protocol import Tokens


def test_in_flight_is_the_records_a_worker_holds_and_a_finish_counts_once():
    pool = two_workers()
    a, b = pool.register(pool.workers[0], "req-a"), pool.register(pool.workers[0], "req-b")
    assert (pool.workers[0].in_flight, pool.workers[1].in_flight) == (2, 0)
    assert pool.owner_of("req-b") is b and b.worker is pool.workers[0]
    pool.finish(a, ok=True)
    pool.finish(a, ok=True)  # a second finish of the same record is a no-op
    pool.finish(b, ok=False)
    w = pool.workers[0]
    assert (w.in_flight, w.served, w.failed_requests, pool.owner_of("req-a")) == (0, 1, 1, None)


def test_events_reach_only_the_record_of_the_worker_that_owns_it():
    pool = two_workers()
    req = pool.register(pool.workers[0], "req-a")
    pool.frame(1, Tokens(request_id="req-a", text_delta="forged", token_ids=[1]))
    pool.frame(0, Tokens(request_id="req-a", text_delta="mine", token_ids=[1]))
    assert req.events.qsize() == 1 and req.events.get_nowait().text_delta == "mine"


def test_wait_change_wakes_on_a_state_change_not_a_timeout():
    async def scenario():
        pool = RecordingPool()
        pool.boot(0, pid=100)
        pool.mark_lost(0, "killed by SIGKILL")
        waiter = asyncio.create_task(pool.wait_change(3600))
        await step()
        assert not waiter.done()
        pool.boot(0, pid=200, restarts=1)
        await step()
        assert waiter.done() and pool.workers[0].state == State.READY

    run(scenario())
