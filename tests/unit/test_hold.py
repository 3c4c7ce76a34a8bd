"""Requests held for a replica of their model (router.hold through router.generation), without
processes: a pool whose frames go through the real decode path and whose sends are recorded."""

from __future__ import annotations

import asyncio

import pytest

from router.admin_protocol import Exited
from router.generation import stream_tokens
from router.hold import HoldQueue
from router.tiers import Urgency
from router.workers import NoWorker
from tests.helpers.router_pool import PARAMS, RecordingPool, collect, run, say, step


def one_worker_restarting(hold_s: float = 30.0, max_waiting: int = 8) -> RecordingPool:
    """One replica, ready once, then lost (its supervisor will start it again)."""
    pool = RecordingPool()
    pool.hold.limits = lambda model: (hold_s, max_waiting)
    pool.boot(0, pid=100)
    pool.mark_lost(0, "killed by SIGKILL")
    return pool


def request(pool: RecordingPool, priority: int = 0, model: str | None = None, prompt=(1, 2)) -> asyncio.Task:
    gen = stream_tokens(pool, list(prompt), PARAMS, max_retries=1, model=model, urgency=Urgency(priority=priority))
    return asyncio.create_task(collect(gen))


def say_to(pool: RecordingPool, wid: int, request_id: str) -> None:
    from worker.contract.protocol import Tokens, Usage

    usage = Usage(prompt_tokens=2, completion_tokens=1, total_tokens=3)
    pool.frame(wid, Tokens(request_id=request_id, text_delta="x", token_ids=[5], finish_reason="stop", usage=usage))


def test_a_request_waits_for_the_restarting_replica_and_is_served_when_it_is_ready():
    async def scenario():
        pool = one_worker_restarting()
        task = request(pool)
        await step()
        assert not task.done() and pool.hold.waiting(None) == 1 and pool.generates() == []
        pool.boot(0, pid=101, restarts=1)
        await step()
        assert pool.hold.waiting(None) == 0 and len(pool.generates()) == 1
        say(pool, "hi", [7], finish="stop", total=1)
        events = await task
        assert events[-1].finish_reason == "stop"

    run(scenario())


def test_held_requests_go_in_priority_then_arrival_order():
    async def scenario():
        pool = one_worker_restarting()
        for n, priority in enumerate([0, 5, -1, 0]):  # request n sends prompt [n]
            request(pool, priority, prompt=[n])
            await step()
        pool.boot(0, pid=101, restarts=1)
        for _ in range(4):
            await step()
        assert [gen.prompt_token_ids for _, gen in pool.generates()] == [[2], [0], [3], [1]]
        assert pool.hold.waiting(None) == 0

    run(scenario())


def test_held_requests_beyond_the_replicas_room_wait_for_room_in_order():
    async def scenario():
        pool = one_worker_restarting(max_waiting=64)
        for n in range(20):  # the replica holds 8 + 8 (max_num_seqs + max_waiting): 4 stay held
            request(pool, prompt=[n])
        await step()
        pool.boot(0, pid=101, restarts=1)
        for _ in range(20):
            await step()
        assert len(pool.generates()) == 16 and pool.hold.waiting(None) == 4
        say_to(pool, 0, pool.generates()[0][1].request_id)
        for _ in range(3):
            await step()
        assert [gen.prompt_token_ids for _, gen in pool.generates()][-1] == [16]

    run(scenario())


def test_a_full_hold_queue_answers_503_at_once_with_retry_after():
    async def scenario():
        pool = one_worker_restarting(max_waiting=2)
        held = [request(pool), request(pool)]
        await step()
        with pytest.raises(NoWorker) as err:
            await collect(stream_tokens(pool, [1], PARAMS, max_retries=1))
        assert err.value.status == 503 and err.value.headers == {"Retry-After": "5"}
        assert "2 requests already wait" in err.value.message
        assert pool.hold.waiting(None) == 2
        for t in held:
            t.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        assert pool.hold.waiting(None) == 0  # a client gone leaves the queue

    run(scenario())


def test_a_request_held_past_hold_s_gets_503():
    async def scenario():
        pool = one_worker_restarting(hold_s=0.05)
        left: list[tuple[str, float]] = []
        pool.hold.on_leave = lambda model, outcome, s: left.append((outcome, s))
        with pytest.raises(NoWorker) as err:
            await collect(stream_tokens(pool, [1], PARAMS, max_retries=1))
        assert "within 0s (router.hold_s)" in err.value.message and err.value.headers == {"Retry-After": "5"}
        assert left[0][0] == "timeout" and left[0][1] >= 0.05

    run(scenario())


def test_held_requests_are_answered_at_once_when_their_model_is_removed_or_fails():
    async def scenario():
        for report in (
            Exited(reason="retired (scaled down)", removed=True),
            Exited(reason="crashed 5 times", failed=True),
        ):
            pool = one_worker_restarting()
            task = request(pool)
            await step()
            assert not task.done()
            pool.on_report(0, report)
            await step()
            with pytest.raises(NoWorker) as err:
                await task
            assert "none is expected" in err.value.message
            assert pool.model_state(None) == "unavailable"

    run(scenario())


def test_a_model_with_no_replica_expected_is_answered_at_once_not_held():
    async def scenario():
        pool = one_worker_restarting()
        pool.on_report(0, Exited(reason="crashed 5 times", failed=True))
        with pytest.raises(NoWorker):
            await collect(stream_tokens(pool, [1], PARAMS, max_retries=1))
        assert pool.hold.waiting(None) == 0

    run(scenario())


def test_held_requests_get_503_when_the_router_stops_accepting():
    """A router shutting down (SIGTERM, /admin/shutdown) answers what it holds at once; the standby
    router that takes over never sees them (their connections belong to the old process)."""

    async def scenario():
        pool = one_worker_restarting()
        task = request(pool)
        await step()
        pool.stop_accepting()
        await step()
        with pytest.raises(NoWorker) as err:
            await task
        assert "shutting down" in err.value.message and pool.hold.waiting(None) == 0

    run(scenario())


def test_only_the_requests_model_releases_its_queue():
    async def scenario():
        pool = RecordingPool()
        pool.boot(0, pid=100, model="chat")
        pool.boot(1, pid=101, model="embed")
        pool.mark_lost(0, "killed")
        task = request(pool, model="chat")
        await step()
        assert pool.hold.by_model() == {"chat": 1}
        assert (pool.model_state("chat"), pool.model_state("embed")) == ("loading", "ready")
        pool.boot(0, pid=102, model="chat", restarts=1)
        await step()
        assert pool.generates()[-1][0] == 0
        say(pool, "ok", [3], finish="stop", total=1)
        assert (await task)[-1].finish_reason == "stop"

    run(scenario())


def test_a_new_router_holds_requests_until_the_supervisor_reports_its_workers():
    async def scenario():
        pool = RecordingPool()  # no slot reported yet: a start in progress
        assert pool.expects(None) and pool.model_state(None) == "loading"
        task = request(pool)
        await step()
        pool.boot(0, pid=100)
        await step()
        say(pool, "ok", [3], finish="stop", total=1)
        assert (await task)[-1].finish_reason == "stop"

    run(scenario())


def test_hold_queue_leave_is_idempotent_and_counts_once():
    seen = []
    q = HoldQueue(lambda m: (10.0, 4))
    q.on_leave = lambda model, outcome, s: seen.append(outcome)
    a, b = q.join("m", 1), q.join("m", 0)
    assert q.is_head(b) and not q.is_head(a)
    q.leave(b, "dispatched")
    q.leave(b, "cancelled")
    assert seen == ["dispatched"] and q.is_head(a) and q.by_model() == {"m": 1}


def test_held_requests_and_time_held_show_in_metrics_and_the_status_feed_under_the_models_name():
    from prometheus_client.parser import text_string_to_metric_families

    from router.metrics import Metrics

    async def scenario():
        pool = one_worker_restarting()
        metrics = Metrics(pool)
        model = pool.workers[0].model
        tasks = [request(pool), request(pool)]
        await step()
        await asyncio.sleep(0.05)
        assert pool.hold.by_model() == {"": 2} and pool.hold.oldest_s()[""] >= 0.0  # the status page's feed
        assert sample(metrics, "llamadeploy_num_requests_held", model=model) == 2
        pool.boot(0, pid=101, restarts=1)
        await step()
        assert sample(metrics, "llamadeploy_num_requests_held", model=model) == 0
        labels = {"model": model, "outcome": "dispatched"}
        assert sample(metrics, "llamadeploy_request_hold_seconds_count", **labels) == 2
        assert sample(metrics, "llamadeploy_request_hold_seconds_sum", **labels) >= 0.09
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def sample(metrics, name: str, **labels) -> float:
        text = metrics.exposition().decode()
        found = [
            s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == name and s.labels == labels
        ]
        assert len(found) == 1, (name, labels, text)
        return found[0]

    run(scenario())
