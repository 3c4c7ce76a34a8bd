"""The thread governor (worker/cpu_share.py): fewer compute threads while the cores are taken, all of
them again when the cores are free or on a retry, the retry's wait doubling on premature returns.
Fake clock and readings: each test says what the kernel would have counted."""

from __future__ import annotations

import itertools
import threading

import pytest

from worker import cpu_share
from worker.cpu_share import FLAP_S, RETRY_S, WINDOW_S, Readings, ThreadGovernor

ENGINE, OMP, ZMQ = 11, 12, 13  # thread ids: the engine's, an OpenMP worker's, ZeroMQ's I/O thread


class Box:
    """A fake machine: the test advances time and says, per window, how long the worker's compute
    threads waited to run and how many cores sat idle (per second). ZeroMQ's thread wakes briefly
    and waits a little each time, as measured: its waiting must not count."""

    def __init__(self):
        self.now = 100.0
        self.threads = {ENGINE: (0.0, 0.0), OMP: (0.0, 0.0), ZMQ: (0.0, 0.0)}
        self.idle = 0.0
        self.applied: list[int] = []

    def read(self) -> Readings:
        return Readings(threads=dict(self.threads), idle_s=self.idle)

    def wait(self, tid: int, ran: float, waited: float) -> None:
        r, w = self.threads[tid]
        self.threads[tid] = (r + ran, w + waited)

    def window(self, gov: ThreadGovernor, waiting: float, idle: float, seconds: float = WINDOW_S) -> None:
        """``seconds`` of stepping during which the compute threads waited ``waiting`` s/s in all and
        ``idle`` cores sat idle."""
        self.now += seconds
        for tid in (ENGINE, OMP):
            self.wait(tid, (1 - waiting / 2) * seconds, waiting / 2 * seconds)
        self.wait(ZMQ, 0.01 * seconds, 0.3 * seconds)
        self.idle += idle * seconds
        gov.observe(True)


def governor(box: Box, most: int = 2) -> ThreadGovernor:
    gov = ThreadGovernor(most, box.read, box.applied.append, clock=lambda: box.now)
    gov.observe(True)  # the first turn of stepping opens the window
    return gov


def test_quiet_cores_keep_every_thread():
    box = Box()
    gov = governor(box)
    for _ in range(40):
        box.window(gov, waiting=0.2, idle=0.1)  # the router and a client take a little, as measured quiet
    assert gov.threads == 2 and box.applied == [] and gov.changes == 0


def test_taken_cores_drop_to_what_is_left_and_return_when_free():
    box = Box()
    gov = governor(box)
    box.window(gov, waiting=1.0, idle=0.0)  # a busy loop took one of the two cores
    assert gov.threads == 1 and box.applied == [1]
    box.window(gov, waiting=0.0, idle=0.0)  # one thread runs unhindered; nothing idle: stay
    assert gov.threads == 1
    box.window(gov, waiting=0.0, idle=0.9)  # the loop ended: one window free is not yet enough
    assert gov.threads == 1
    box.window(gov, waiting=0.0, idle=0.9)
    assert gov.threads == 2 and box.applied == [1, 2] and gov.changes == 2


def test_the_drop_removes_one_thread_per_core_missing():
    box = Box()
    gov = governor(box, most=8)
    box.window(gov, waiting=2.6, idle=0.0)  # about three cores' worth of waiting
    assert box.applied == [5]
    box.window(gov, waiting=0.9, idle=0.0)  # still taken: one fewer
    assert box.applied == [5, 4]
    box.window(gov, waiting=0.0, idle=0.75 * 4 - 0.01)  # not quite four free cores for four missing threads
    box.window(gov, waiting=0.0, idle=0.75 * 4 - 0.01)
    assert gov.threads == 4


def test_a_window_is_only_steady_stepping():
    box = Box()
    gov = governor(box)
    box.now += WINDOW_S / 2
    box.wait(ENGINE, 0.0, 5.0)  # waited while idle between requests (e.g. the loop blocked): says nothing
    gov.observe(False)
    gov.observe(True)  # a new window starts here
    box.window(gov, waiting=0.1, idle=0.0)
    assert gov.threads == 2
    box.window(gov, waiting=0.8, idle=0.0, seconds=WINDOW_S / 2)  # half a window, not plainly taken: wait
    assert gov.threads == 2
    box.window(gov, waiting=0.4, idle=0.0, seconds=WINDOW_S / 2)  # the window closes over both: 0.6 s/s
    assert gov.threads == 1


def test_cores_plainly_taken_are_seen_after_one_slow_step():
    box = Box()
    gov = governor(box)
    box.window(gov, waiting=0.0, idle=0.0, seconds=0.02)  # too soon to look
    assert gov.threads == 2
    box.window(gov, waiting=1.0, idle=0.0, seconds=0.4)  # one step that waited at every barrier
    assert gov.threads == 1 and box.applied == [1]
    dropped = box.now
    while gov.threads == 1:
        box.window(gov, waiting=0.0, idle=0.0, seconds=0.05)
    box.window(gov, waiting=0.0, idle=0.0, seconds=0.02)
    box.window(gov, waiting=1.0, idle=0.0, seconds=0.4)  # the retry's first step: still taken
    assert box.applied == [1, 2, 1] and box.now - dropped < RETRY_S + WINDOW_S + 0.5


def test_a_retry_comes_without_idle_cores_and_backs_off_when_premature():
    box = Box()
    gov = governor(box)
    box.window(gov, waiting=1.0, idle=0.0)
    waits = []
    for _ in range(4):
        dropped = box.now
        while gov.threads == 1:  # the router and clients keep the cores from looking idle
            box.window(gov, waiting=0.0, idle=0.3)
        waits.append(box.now - dropped)
        box.window(gov, waiting=1.0, idle=0.0)  # the competitor is still there
        assert gov.threads == 1
    assert waits[0] == pytest.approx(RETRY_S, abs=WINDOW_S)
    for a, b in itertools.pairwise(waits):
        assert b == pytest.approx(2 * a, abs=WINDOW_S)


def test_a_drop_long_after_a_return_starts_the_retry_wait_again():
    box = Box()
    gov = governor(box)
    box.window(gov, waiting=1.0, idle=0.0)
    while gov.threads == 1:
        box.window(gov, waiting=0.0, idle=0.3)
    box.window(gov, waiting=1.0, idle=0.0)  # premature: the next retry waits twice as long
    for _ in range(int(cpu_share.CALM_S / WINDOW_S) + 20):
        box.window(gov, waiting=0.0, idle=0.9)  # back on two threads, quiet for over a minute
    assert gov.threads == 2
    box.window(gov, waiting=1.0, idle=0.0)
    dropped = box.now
    while gov.threads == 1:
        box.window(gov, waiting=0.0, idle=0.3)
    assert box.now - dropped == pytest.approx(RETRY_S, abs=WINDOW_S)
    assert FLAP_S < cpu_share.CALM_S


def test_one_thread_is_never_governed_below_one():
    box = Box()
    gov = governor(box, most=2)
    box.window(gov, waiting=3.0, idle=0.0)
    box.window(gov, waiting=3.0, idle=0.0)
    assert gov.threads == 1 and box.applied == [1]


def test_nothing_is_governed_where_it_cannot_or_should_not_be(monkeypatch):
    assert cpu_share.governor_for(1, True, False, False) is None
    assert cpu_share.governor_for(2, False, False, False) is None
    assert cpu_share.governor_for(2, True, True, False) is None
    assert cpu_share.governor_for(2, True, False, True) is None
    monkeypatch.setattr(cpu_share, "proc_readings", lambda cpus=None: None)
    assert cpu_share.governor_for(2, True, False, False) is None


def test_a_thread_that_mostly_sleeps_is_not_a_compute_thread():
    first = Readings(threads={ENGINE: (0.0, 0.0), ZMQ: (0.0, 0.0)}, idle_s=0.0)
    last = Readings(threads={ENGINE: (0.4, 0.1), ZMQ: (0.02, 0.2), 99: (0.1, 0.4)}, idle_s=0.0)
    # the engine's thread: 0.1 s waited; ZeroMQ's wanted a core 22% of the time; 99 is new: no baseline
    assert cpu_share.compute_waiting(first, last, 1.0) == pytest.approx(0.1)


def test_the_real_readings_count_up():
    read = cpu_share.proc_readings()
    assert read is not None  # Linux: the suite's machines have /proc with schedstats
    a = read()
    x = 0
    for i in range(2_000_000):
        x += i
    b = read()
    me = threading.get_native_id()
    assert b.threads[me][0] > a.threads[me][0] and b.threads[me][1] >= a.threads[me][1] >= 0
    assert b.idle_s >= a.idle_s >= 0
