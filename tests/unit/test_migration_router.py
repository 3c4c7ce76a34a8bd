"""The router's side of request migration, without processes: what a lost worker's requests send
to the next worker (prompt, parameters, every generated id), what the client sees (no duplicate,
one finish), and the limits (``max_migrations``, retries). Frames go through the pool's real
decode path; only the socket send is recorded (``RecordingPool``)."""

from __future__ import annotations

import asyncio

import pytest

from router.errors import ApiError
from router.generation import stream_tokens
from tests.helpers.router_pool import PARAMS, RecordingPool, collect, run, say, step, two_workers
from worker.contract.protocol import Failed, SamplingParams, Usage


def test_a_stream_migrates_with_every_generated_id_and_continues_without_duplicates():
    async def scenario():
        pool = two_workers()
        params = SamplingParams(max_tokens=6, temperature=0.8, seed=7, stop=["END"])
        moves: list[str] = []
        task = asyncio.create_task(
            collect(stream_tokens(pool, [1, 2, 3], params, max_retries=1, max_migrations=3, on_migration=moves.append))
        )
        await step()
        say(pool, "Hello", [11])
        say(pool, " wor", [12, 13])  # two tokens in one delta (one was held back)
        await step()
        first, _ = pool.generates()[0]
        pool.mark_lost(first, "killed by SIGKILL")
        await step()
        second, gen = pool.generates()[1]
        assert second != first
        assert (gen.prompt_token_ids, gen.params, gen.output_token_ids) == ([1, 2, 3], params, [11, 12, 13])
        say(pool, "ld", [14], finish="length", total=4)
        events = await task
        assert [e.text_delta for e in events] == ["Hello", " wor", "ld"]
        assert [e.finish_reason for e in events] == [None, None, "length"]
        assert events[-1].usage == Usage(prompt_tokens=3, completion_tokens=4, total_tokens=7)
        assert moves == ["exited"] and pool.in_flight() == 0
        assert (pool.workers[first].failed_requests, pool.workers[second].served) == (1, 1)

    run(scenario())


def test_a_non_streaming_request_migrates_and_returns_one_whole_answer():
    async def scenario():
        pool = two_workers()
        task = asyncio.create_task(
            collect(stream_tokens(pool, [1], PARAMS, max_retries=1, buffered=True, max_migrations=1))
        )
        await step()
        say(pool, "first half ", [5, 6])
        await step()
        pool.mark_lost(pool.generates()[0][0], "no heartbeat for 10s", kind="heartbeat_timeout")
        await step()
        assert pool.generates()[1][1].output_token_ids == [5, 6]
        say(pool, "second half", [7], finish="stop", total=3)
        (event,) = await task
        assert (event.text_delta, event.token_ids, event.finish_reason) == ("first half second half", [5, 6, 7], "stop")
        assert event.usage.completion_tokens == 3

    run(scenario())


def test_a_worker_leaving_while_shutting_down_is_a_migration_too():
    async def scenario():
        pool = two_workers()
        moves: list[str] = []
        task = asyncio.create_task(
            collect(stream_tokens(pool, [1], PARAMS, max_retries=0, max_migrations=1, on_migration=moves.append))
        )
        await step()
        say(pool, "a", [5])
        await step()
        wid, gen = pool.generates()[0]
        pool.frame(wid, Failed(request_id=gen.request_id, code=503, message=f"worker {wid} is shutting down"))
        await step()
        say(pool, "b", [6], finish="length", total=2)
        assert [e.text_delta for e in await task] == ["a", "b"] and moves == ["shutting_down"]

    run(scenario())


def test_a_worker_out_of_capacity_is_the_clients_503_with_retry_after_not_a_migration():
    async def scenario():
        pool = two_workers()
        task = asyncio.create_task(collect(stream_tokens(pool, [1], PARAMS, max_retries=1, max_migrations=1)))
        await step()
        wid, gen = pool.generates()[0]
        pool.frame(
            wid, Failed(request_id=gen.request_id, code=503, message="waited too long for KV memory", retry_after_s=5.0)
        )
        with pytest.raises(ApiError) as err:
            await task
        assert err.value.status == 503 and err.value.headers == {"Retry-After": "5"}
        assert len(pool.generates()) == 1 and pool.in_flight() == 0

    run(scenario())


def test_migrations_stop_at_max_migrations_with_a_502():
    async def scenario():
        pool = two_workers()
        task = asyncio.create_task(collect(stream_tokens(pool, [1], PARAMS, max_retries=1, max_migrations=1)))
        await step()
        say(pool, "a", [5])
        await step()
        pool.mark_lost(pool.generates()[0][0], "killed by SIGKILL")
        await step()
        say(pool, "b", [6])
        await step()
        pool.mark_lost(pool.generates()[1][0], "killed by SIGSEGV")
        with pytest.raises(ApiError) as err:
            await task
        assert err.value.status == 502 and err.value.code == "worker_lost"
        assert "SIGSEGV" in err.value.message and "after 1 migration" in err.value.message
        assert len(pool.generates()) == 2 and pool.in_flight() == 0

    run(scenario())


def test_a_loss_before_any_token_is_a_retry_from_the_start_not_a_migration():
    async def scenario():
        pool = two_workers()
        moves: list[str] = []
        task = asyncio.create_task(
            collect(stream_tokens(pool, [1], PARAMS, max_retries=1, max_migrations=3, on_migration=moves.append))
        )
        await step()
        pool.mark_lost(pool.generates()[0][0], "killed by SIGKILL")
        await step()
        assert pool.generates()[1][1].output_token_ids == []
        say(pool, "ok", [5], finish="stop", total=1)
        assert [e.text_delta for e in await task] == ["ok"] and moves == []

    run(scenario())


def test_a_migration_waits_for_the_only_worker_to_come_back():
    async def scenario():
        pool = RecordingPool()
        pool.boot(0, pid=100)
        task = asyncio.create_task(collect(stream_tokens(pool, [1], PARAMS, max_retries=1, max_migrations=1)))
        await step()
        say(pool, "a", [5])
        await step()
        pool.mark_lost(0, "killed by SIGKILL")
        await asyncio.sleep(0.3)
        assert not task.done() and len(pool.generates()) == 1
        pool.boot(0, pid=200, restarts=1)
        await asyncio.sleep(0.3)
        assert pool.generates()[1][1].output_token_ids == [5]
        say(pool, "b", [6], finish="length", total=2)
        assert [e.text_delta for e in await task] == ["a", "b"]

    run(scenario())
