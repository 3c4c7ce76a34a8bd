"""Hung, not dead: a worker whose engine makes no step while it has work, though its I/O thread
still heartbeats, is declared dead (``stalled``) and its requests move; an idle worker, a worker
making progress, or an engine that does not report its steps never is. Heartbeats go through the
pool's real decode path (``RecordingPool``); time is passed to ``check_workers``."""

from __future__ import annotations

import asyncio
import time

from router.generation import stream_tokens
from router.workers import State
from tests.helpers.router_pool import PARAMS, RecordingPool, collect, run, say, step, two_workers
from worker.contract.protocol import Heartbeat

STALL_S = 30.0


def beat(pool: RecordingPool, wid: int, steps: int | None, running: int = 1, age: float | None = None) -> None:
    pool.frame(
        wid,
        Heartbeat(
            worker_id=wid, running=running, waiting=0, kv_used_tokens=0, mem_bytes=0, steps=steps, last_step_age_s=age
        ),
    )


def watched() -> RecordingPool:
    pool = two_workers()
    pool.stall_timeout_s = STALL_S
    pool.heartbeat_timeout_s = 1e9  # silence is another test's subject: only stalls here
    return pool


def test_a_busy_worker_without_engine_steps_is_declared_dead_and_its_request_migrates():
    async def scenario():
        pool = watched()
        moves: list[str] = []
        task = asyncio.create_task(
            collect(stream_tokens(pool, [1], PARAMS, max_retries=0, max_migrations=1, on_migration=moves.append))
        )
        await step()
        wid = pool.generates()[0][0]
        beat(pool, wid, steps=40)
        say(pool, "a", [5])
        await step()
        beat(pool, wid, steps=41)  # one more step, then nothing
        stuck_since = time.monotonic()
        beat(pool, wid, steps=41)
        pool.check_workers(stuck_since + STALL_S - 1)
        assert pool.workers[wid].state == State.READY
        pool.check_workers(stuck_since + STALL_S + 1)
        w = pool.workers[wid]
        assert w.state == State.DEAD and w.exit_reason.startswith("stalled: no engine step for"), w.exit_reason
        await step()
        other, gen = pool.generates()[1]
        assert other != wid and gen.output_token_ids == [5]
        say(pool, "b", [6], finish="length", total=2)
        assert [e.text_delta for e in await task] == ["a", "b"] and moves == ["stalled"]

    run(scenario())


class Clock:
    """``time.monotonic`` for the synchronous tests below (heartbeat times are read from it)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def clocked(monkeypatch) -> tuple[RecordingPool, Clock]:
    clock = Clock()
    monkeypatch.setattr(time, "monotonic", clock)
    return watched(), clock


def test_a_worker_making_steps_or_idle_is_never_stalled(monkeypatch):
    pool, clock = clocked(monkeypatch)
    for i in range(10):  # 10 heartbeats over 5 stall timeouts
        beat(pool, 0, steps=100 + i)  # busy and stepping
        beat(pool, 1, steps=7, running=0)  # idle: no step needed
        clock.now += STALL_S / 2
        pool.check_workers(clock.now)
    assert [w.state for w in pool.workers.values()] == [State.READY, State.READY]


def test_a_busy_worker_whose_steps_stop_is_stalled_after_the_timeout(monkeypatch):
    pool, clock = clocked(monkeypatch)
    beat(pool, 0, steps=5)
    for _ in range(5):  # heartbeats keep coming, the step counter does not move
        clock.now += STALL_S / 4
        beat(pool, 0, steps=5)
        pool.check_workers(clock.now)
    assert pool.workers[0].state == State.DEAD and pool.workers[0].exit_reason.startswith("stalled")


def test_the_stall_clock_starts_when_work_arrives_not_at_the_last_step(monkeypatch):
    pool, clock = clocked(monkeypatch)
    beat(pool, 0, steps=7, running=0)
    clock.now += 10 * STALL_S  # idle all that time
    beat(pool, 0, steps=7, running=0)
    beat(pool, 0, steps=7, running=1)  # work arrived; its first step is under way
    clock.now += STALL_S - 1
    beat(pool, 0, steps=7, running=1)
    pool.check_workers(clock.now)
    assert pool.workers[0].state == State.READY


def test_an_engine_that_does_not_report_steps_is_never_declared_stalled(monkeypatch):
    pool, clock = clocked(monkeypatch)
    for _ in range(5):
        beat(pool, 0, steps=None)
        clock.now += STALL_S
        pool.check_workers(clock.now)
    assert pool.workers[0].state == State.READY


def test_the_last_step_age_alone_declares_a_stall_once_work_waited_that_long(monkeypatch):
    pool, clock = clocked(monkeypatch)
    beat(pool, 0, steps=None, running=0, age=500.0)  # idle: its last step was long ago
    beat(pool, 0, steps=None, age=500.0)  # busy from now
    clock.now += STALL_S - 1
    beat(pool, 0, steps=None, age=529.0)
    pool.check_workers(clock.now)
    assert pool.workers[0].state == State.READY  # busy for less than the stall timeout
    clock.now += 2
    beat(pool, 0, steps=None, age=531.0)
    pool.check_workers(clock.now)
    assert pool.workers[0].state == State.DEAD


def test_the_stall_fault_names_workers_like_the_crash_fault():
    from worker.main import FAULT_STALL, fault_names

    assert fault_names(FAULT_STALL, 1, {FAULT_STALL: "0,1"}) and not fault_names(FAULT_STALL, 2, {FAULT_STALL: "0,1"})
    assert fault_names(FAULT_STALL, 5, {FAULT_STALL: "all"}) and not fault_names(FAULT_STALL, 0, {})
