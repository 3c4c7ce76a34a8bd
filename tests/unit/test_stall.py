"""Hung, not dead: a worker whose engine makes no step while it has work, though its I/O thread
still heartbeats, is declared dead (``stalled``) and its requests move; an idle worker, a worker
making progress, or an engine that does not report its steps never is. Heartbeats go through the
pool's real decode path (``RecordingPool``); time is passed to ``check_workers``."""

from __future__ import annotations

import asyncio
import time

from router.generation import stream_tokens
from router.stall import HARD_LIMIT_FACTOR, MIN_CPU_SHARE, is_stalled, no_step_for
from router.workers import State
from tests.helpers.router_pool import PARAMS, RecordingPool, collect, run, say, step, two_workers
from worker.contract.protocol import EngineLoad, Heartbeat

STALL_S = 30.0


def beat(
    pool: RecordingPool,
    wid: int,
    steps: int | None,
    running: int = 1,
    age: float | None = None,
    cpu: float | None = None,
) -> None:
    load = EngineLoad(running=running, steps=steps, last_step_age_s=age, cpu_s=cpu)
    pool.frame(wid, Heartbeat(worker_id=wid, load=load))


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


def test_no_step_for_takes_the_smaller_of_the_router_clock_and_the_worker_clock():
    assert no_step_for(40.0, None, 3.0) == 40.0  # the worker does not report its step age
    assert no_step_for(40.0, 2.0, 3.0) == 5.0  # its heartbeat, 3 s old, said it stepped 2 s before
    assert no_step_for(4.0, 500.0, 0.0) == 4.0  # idle for long, work arrived 4 s ago
    assert no_step_for(-1.0, None, 0.0) == 0.0


def test_is_stalled_needs_the_timeout_and_next_to_no_cpu_or_the_hard_limit():
    t = STALL_S
    assert not is_stalled(t, 0.0, t)  # not past the timeout
    assert is_stalled(t + 1, None, t)  # CPU not reported: the step clocks alone decide
    assert is_stalled(t + 1, 0.01, t)  # waiting, not computing: hung
    busy_cpu = MIN_CPU_SHARE * (t + 1) * 2
    assert not is_stalled(t + 1, busy_cpu, t)  # computing a slow step on a shared host
    assert not is_stalled(HARD_LIMIT_FACTOR * t, busy_cpu * 4, t)
    assert is_stalled(HARD_LIMIT_FACTOR * t + 1, 1e6, t)  # a spinning sync on a hung kernel: hung at last


def test_a_busy_worker_computing_a_slow_step_is_not_stalled_until_the_hard_limit(monkeypatch):
    pool, clock = clocked(monkeypatch)
    beat(pool, 0, steps=5, age=0.0, cpu=100.0)
    cpu = 100.0
    while clock.now - 1000.0 <= HARD_LIMIT_FACTOR * STALL_S:  # one long step, half a core all the time
        clock.now += STALL_S / 4
        cpu += STALL_S / 8
        beat(pool, 0, steps=5, age=clock.now - 1000.0, cpu=cpu)
        pool.check_workers(clock.now)
        if clock.now - 1000.0 <= HARD_LIMIT_FACTOR * STALL_S:
            assert pool.workers[0].state == State.READY, clock.now
    assert pool.workers[0].state == State.DEAD and pool.workers[0].exit_reason.startswith("stalled")


def test_a_busy_worker_waiting_without_cpu_is_stalled_after_the_timeout(monkeypatch):
    pool, clock = clocked(monkeypatch)
    beat(pool, 0, steps=5, age=0.0, cpu=100.0)
    for _ in range(5):  # heartbeats go on, the step counter and the CPU clock barely move
        clock.now += STALL_S / 4
        beat(pool, 0, steps=5, age=clock.now - 1000.0, cpu=100.0 + 0.001 * (clock.now - 1000.0))
        pool.check_workers(clock.now)
    assert pool.workers[0].state == State.DEAD and pool.workers[0].exit_reason.startswith("stalled")
