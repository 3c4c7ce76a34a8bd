"""The router's side of supervision, without processes: worker states, restart counts, failover
and in-flight accounting. Frames go through the real decode path (``pool.link.dispatch``); only the
socket send is replaced by a recorder."""

from __future__ import annotations

import asyncio

import pytest

from router.errors import ApiError
from router.generation import stream_tokens
from router.workers import NoWorker, State
from tests.helpers.router_pool import PARAMS, RecordingPool, collect, run, step, two_workers
from worker.contract.protocol import (
    PROTOCOL_VERSION,
    Bye,
    Cancel,
    Failed,
    Hello,
    Ready,
)


def test_restart_count_is_one_after_one_crash():
    pool = two_workers()
    pool.mark_lost(0, "killed by SIGKILL")  # the supervisor's report
    assert pool.workers[0].state == State.DEAD
    pool.boot(0, pid=200, restarts=1)
    w = pool.workers[0]
    assert (w.state, w.pid, w.restarts, w.exit_reason) == (State.READY, 200, 1, "killed by SIGKILL")


def test_crash_before_hello_is_counted_and_failed_is_kept():
    pool = two_workers()
    for restarts, pid in enumerate([300, 301, 302], start=1):
        pool.mark_lost(1, "exit code 3")
        pool.on_started(1, pid, restarts, "cpu[1]")
        assert pool.workers[1].state == State.STARTING and pool.workers[1].pid == pid
    pool.mark_lost(1, "exit code 3", failed=True)
    assert (pool.workers[1].state, pool.workers[1].restarts) == (State.FAILED, 3)
    assert [w.worker_id for w in pool.ready_workers()] == [0]


def test_start_request_only_for_a_worker_without_process():
    pool = two_workers()
    assert not pool.request_start(0)
    pool.mark_lost(0, "exit code 1", failed=True)
    assert pool.request_start(0) and pool.workers[0].info()["start_requested"]
    pool.on_started(0, 400, 4, "cpu[0]")
    assert not pool.workers[0].start_requested and pool.workers[0].state == State.STARTING


def test_clean_exit_after_bye_stays_stopped():
    pool = two_workers()
    pool.frame(0, Bye(worker_id=0, reason="restart requested"))
    pool.mark_lost(0, "exit code 0")
    assert pool.workers[0].state == State.STOPPED


def test_non_streaming_retries_after_tokens_and_returns_only_the_new_attempt():
    async def scenario():
        pool = two_workers()
        task = asyncio.create_task(collect(stream_tokens(pool, [1, 2], PARAMS, max_retries=1, buffered=True)))
        await step()
        first, _ = pool.generates()[0]
        pool.tokens("lost ")
        await step()
        pool.mark_lost(first, "killed by SIGKILL")
        await step()
        second, _ = pool.generates()[1]
        assert second != first
        pool.tokens("kept ")
        pool.tokens("text", finish="length")
        events = await task
        assert [e.text_delta for e in events] == ["kept text"] and events[0].finish_reason == "length"
        assert pool.in_flight() == 0
        assert (pool.workers[first].failed_requests, pool.workers[second].served) == (1, 1)

    run(scenario())


def test_stream_with_text_delivered_fails_with_502_and_releases():
    async def scenario():
        pool = two_workers()
        got: list[str] = []

        async def consume():
            async for t in stream_tokens(pool, [1], PARAMS, max_retries=1):
                got.append(t.text_delta)

        task = asyncio.create_task(consume())
        await step()
        pool.tokens("Hello")
        await step()
        pool.mark_lost(pool.generates()[0][0], "killed by SIGKILL")
        with pytest.raises(ApiError) as err:
            await task
        assert err.value.status == 502 and err.value.code == "worker_lost" and "SIGKILL" in err.value.message
        assert got == ["Hello"] and len(pool.generates()) == 1 and pool.in_flight() == 0

    run(scenario())


def test_stream_without_text_is_retried_once_then_502():
    async def scenario():
        pool = two_workers()
        task = asyncio.create_task(collect(stream_tokens(pool, [1], PARAMS, max_retries=1)))
        await step()
        pool.mark_lost(pool.generates()[0][0], "gone")
        await step()
        wid, gen = pool.generates()[1]
        pool.frame(wid, Failed(request_id=gen.request_id, code=503, message="worker 1 is shutting down"))
        with pytest.raises(ApiError) as err:
            await task
        assert err.value.status == 502 and pool.in_flight() == 0

    run(scenario())


def test_timeout_cancels_on_the_worker_and_releases():
    async def scenario():
        pool = two_workers()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await collect(stream_tokens(pool, [1], PARAMS, max_retries=1))
        wid, gen = pool.generates()[0]
        assert (wid, Cancel(request_id=gen.request_id)) in pool.sent
        assert pool.in_flight() == 0 and pool.workers[wid].failed_requests == 1

    run(scenario())


def test_shutdown_refuses_new_requests_but_retries_accepted_ones():
    async def scenario():
        pool = two_workers()
        task = asyncio.create_task(collect(stream_tokens(pool, [1], PARAMS, max_retries=1, buffered=True)))
        await step()
        pool.accepting = False
        with pytest.raises(NoWorker):
            await collect(stream_tokens(pool, [1], PARAMS, max_retries=1))
        pool.mark_lost(pool.generates()[0][0], "killed by SIGKILL")
        await step()
        pool.tokens("done", finish="stop")
        assert [e.text_delta for e in await task] == ["done"]
        assert pool.in_flight() == 0

    run(scenario())


def test_drain_waits_for_in_flight_then_reports_idle():
    async def scenario():
        pool = two_workers()
        task = asyncio.create_task(collect(stream_tokens(pool, [1], PARAMS, max_retries=1, buffered=True)))
        await step()
        wid = pool.generates()[0][0]
        drain = asyncio.create_task(pool.drain(wid, timeout_s=5))
        await step()
        assert pool.workers[wid].state == State.DRAINING and not drain.done()
        assert pool.pick().worker_id != wid
        pool.tokens("ok", finish="stop")
        await task
        assert await drain is True

    run(scenario())


def test_retry_waits_for_the_only_worker_to_come_back():
    async def scenario():
        pool = RecordingPool()
        pool.boot(0, pid=100)
        task = asyncio.create_task(collect(stream_tokens(pool, [1], PARAMS, max_retries=1, buffered=True)))
        await step()
        pool.mark_lost(0, "killed by SIGKILL")  # one replica: nothing else is ready
        await asyncio.sleep(0.3)
        assert not task.done() and len(pool.generates()) == 1
        pool.boot(0, pid=200, restarts=1)
        await asyncio.sleep(0.3)
        assert len(pool.generates()) == 2
        pool.tokens("back", finish="stop")
        events = await task
        assert [e.text_delta for e in events] == ["back"] and pool.in_flight() == 0

    run(scenario())


def test_retry_fails_with_502_when_no_worker_can_come_back():
    async def scenario():
        pool = RecordingPool()
        pool.boot(0, pid=100)
        task = asyncio.create_task(collect(stream_tokens(pool, [1], PARAMS, max_retries=1, buffered=True)))
        await step()
        pool.mark_lost(0, "killed by SIGKILL", failed=True)  # the supervisor gave up on it
        with pytest.raises(ApiError) as err:
            await task
        assert err.value.status == 502 and err.value.code == "worker_lost" and "SIGKILL" in err.value.message
        assert pool.in_flight() == 0

    run(scenario())


def test_the_table_shows_the_node_and_gpus_a_worker_reports():
    pool = RecordingPool()
    pool.on_started(0, 42, 0, "cuda[1]")
    pool.frame(
        0,
        Hello(
            protocol=PROTOCOL_VERSION,
            worker_id=0,
            pid=42,
            device="cuda[1]",
            model="m",
            max_num_seqs=8,
            max_waiting=8,
            node_id="ab" * 28,
            node_ip="10.0.0.7",
            gpu_ids="1",
        ),
    )
    pool.frame(0, Ready(worker_id=0, load_seconds=1.0, kv_budget_tokens=1000, gpu_uuids=["GPU-1234"]))
    row = pool.workers[0].info()
    assert (row["node_id"], row["node_ip"], row["gpu_ids"], row["gpu_uuids"]) == (
        "ab" * 28,
        "10.0.0.7",
        "1",
        ["GPU-1234"],
    )
    pool.boot(1, 43)  # a local worker reports no node
    assert (pool.workers[1].info()["node_id"], pool.workers[1].info()["node_ip"]) == ("", "")


def test_node_identity_comes_from_the_actors_environment():
    from worker.contract.env import NODE_ID_ENV, NODE_IP_ENV, RAY_GPU_IDS_ENV
    from worker.node import NodeIdentity

    node = NodeIdentity.from_env({NODE_ID_ENV: "f" * 56, NODE_IP_ENV: "10.0.0.8", RAY_GPU_IDS_ENV: "0,1"})
    assert node == NodeIdentity("f" * 56, "10.0.0.8", "0,1")
    assert node.describe() == "node ffffffffffff (10.0.0.8), Ray GPU ids 0,1"
    assert NodeIdentity.from_env({}).describe() == ""


def test_a_requested_start_that_fails_is_not_requested_again():
    """The supervisor retries a start while the table says it is requested; a slot that cannot be
    started (no room left on the cluster) reports a failed exit, which must end the request."""
    pool = RecordingPool()
    pool.boot(0, 42)
    pool.mark_lost(0, "crashed too often", failed=True)
    assert pool.request_start(0) and pool.workers[0].info()["start_requested"]
    pool.mark_lost(0, "no Ray node has room for it", failed=True)
    row = pool.workers[0].info()
    assert (row["state"], row["start_requested"], row["exit_reason"]) == (
        "failed",
        False,
        "no Ray node has room for it",
    )
