"""How many threads a CPU worker's steps compute on: as many as the cores can give it now.

A decode step on CPU is hundreds of parallel regions (one per linear layer, attention, norm). Between
them torch's OpenMP threads spin (libgomp's default: waking a sleeping thread costs more than most
regions), and each region ends at a barrier that waits for its slowest thread. That is the fastest
way to run on cores nobody else wants. When something else computes on them at the same weight,
the worker's threads get fewer cores than their number: a descheduled thread holds every barrier up
for a scheduler slice while the others spin away the share it needed. Linux's autogroup scheduling
makes this the usual case, not a corner: every session weighs as one, so a single busy process
started from a shell takes a whole core of two from a worker whose own session (the supervisor
starts each worker in one) runs two threads, whatever its nice value. The measurements, ours on
two threads and on one and llama.cpp's ``llama-server`` (whose thread pool spins too) beside such a
loop, are in docs/benchmarks/results.md, "2026-12-04 (afternoon)".

So :class:`ThreadGovernor` watches the cause, not the symptom: over windows of steady stepping it
reads how long its compute threads (the engine's and torch's OpenMP team) were runnable but not
running — the kernel's run-queue wait, ``/proc/self/task/*/schedstat`` (the kernel's sched-stats.rst, second field) — and how long the
worker's cores sat idle (``/proc/stat``). Waiting to run for more than :data:`WAIT_SHARE` of a
thread's time (summed over threads) means the cores are taken: the steps go to fewer threads, one
per core the wait says is missing. The threads come back when the cores have sat idle for
:data:`FREE_CORES` of a core per missing thread over :data:`UP_WINDOWS` windows in a row, or, since
the router and the clients may keep the cores from looking idle, as a retry :data:`RETRY_S` after
the drop (as the embedding path's :mod:`worker.embed.thread_watch` retries all cores): a retry or
return that the cores take away again within :data:`FLAP_S` doubles the wait for the next retry, up
to :data:`MAX_RETRY_S`, so a lasting competitor costs one slow step a minute: within a window, a look
every :data:`PEEK_S` decides at once when the threads waited nearly all the time (:data:`PEEK_WAIT`).

Changing the thread count never changes a token: with ``workers.deterministic`` each output value
is computed by one thread in one order (``worker/quant/invariance.py``, ``worker/step/attention.h``),
and the integration tests check the same bits at one and two threads. The step-cost calibration
(``worker/step_cost.py``) was measured on all threads; on fewer, a chunk beside decodes takes
proportionally longer, as the decodes do. Pure logic over injected readings and an injected
``set_threads``; :func:`proc_readings` gives the real ones (None where there is no ``/proc``).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

WINDOW_S = 0.5  # stepping without a break this long is one observation
PEEK_S = 0.1  # within a window on several threads, a look this often for cores plainly taken
PEEK_WAIT = 0.9  # ... the threads waited this much (s/s): decided at once, not at the window's end
COMPUTE_SHARE = 0.5  # a thread that ran or waited to run this share of a window computes the steps
WAIT_SHARE = 0.5  # thread-seconds per second runnable but not running beyond which the cores are taken
FREE_CORES = 0.75  # idle cores per missing thread, every window, before the threads come back
UP_WINDOWS = 2  # windows in a row the cores must have been free
RETRY_S = 4.0  # after a drop, all threads are tried again this much later, idle cores or not
MAX_RETRY_S = 64.0  # the retry's wait doubles on each premature return, up to this
FLAP_S = 10.0  # cores taken again this soon after a return: the return was premature
CALM_S = 60.0  # after this long on all threads, the retry's wait starts from RETRY_S again


@dataclass(frozen=True)
class Readings:
    """Cumulative counters read at one instant: ``threads``, per thread id of this process the
    seconds it ran and the seconds it was runnable but not running; ``idle_s``, core-seconds the
    cores it may run on were idle."""

    threads: dict[int, tuple[float, float]]
    idle_s: float


def compute_waiting(first: Readings, last: Readings, seconds: float) -> float:
    """Seconds per second the compute threads waited to run between two readings ``seconds`` apart.
    A compute thread wanted a core (ran or waited) for at least :data:`COMPUTE_SHARE` of the time:
    the engine's thread and torch's OpenMP team; the ZeroMQ and heartbeat threads, which sleep
    almost always and wait briefly each time they wake, would only add noise."""
    waiting = 0.0
    for tid, (ran, waited) in last.threads.items():
        ran0, waited0 = first.threads.get(tid, (ran, waited))
        if (ran - ran0) + (waited - waited0) >= COMPUTE_SHARE * seconds:
            waiting += waited - waited0
    return waiting / seconds


class ThreadGovernor:
    """Sets how many threads the steps compute on, between 1 and ``most`` (the worker's cores).

    ``read()`` returns the current :class:`Readings`; ``set_threads(n)`` applies a count (torch's,
    from the thread that computes: OpenMP's thread count is that thread's setting); ``clock`` is
    monotonic seconds. The engine calls :meth:`observe` once per loop turn, ``stepping`` whether the
    turn computed a step; a turn without one ends the window (idle time says nothing about
    contention). The only writer of :attr:`threads`."""

    def __init__(
        self,
        most: int,
        read: Callable[[], Readings],
        set_threads: Callable[[int], None],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.most = most
        self.threads = most
        self.changes = 0  # how often the count changed since start
        self._read, self._set, self._clock = read, set_threads, clock
        self._start: tuple[float, Readings] | None = None
        self._free_windows = 0
        self._peek_after = PEEK_S  # seconds into the window of the next look
        self._retry_s = RETRY_S
        self._last_up = -math.inf
        self._last_down = -math.inf

    def observe(self, stepping: bool) -> None:
        """One loop turn: closes a window of :data:`WINDOW_S` of stepping and acts on it."""
        if not stepping:
            self._start = None
            return
        now = self._clock()
        if self._start is None:
            self._start, self._peek_after = (now, self._read()), PEEK_S
            return
        began, first = self._start
        if now - began < WINDOW_S:
            if self.threads > 1 and now - began >= self._peek_after:
                self._peek(now, began, first)
            return
        last = self._read()
        self._start, self._peek_after = (now, last), PEEK_S
        seconds = now - began
        waiting = compute_waiting(first, last, seconds)
        idle = max(0.0, last.idle_s - first.idle_s) / seconds
        self._judge(now, waiting, idle)

    def _peek(self, now: float, began: float, first: Readings) -> None:
        """A look within a window: a step on too few cores can take a good part of a second (each of
        its barriers waits a slice), so a retry on cores still taken, or a competitor's start, is
        decided after the step that shows it rather than after the window's several."""
        self._peek_after = now - began + PEEK_S
        last = self._read()
        waiting = compute_waiting(first, last, now - began)
        if waiting > PEEK_WAIT:
            self._start, self._peek_after = (now, last), PEEK_S
            self._judge(now, waiting, 0.0)

    def _judge(self, now: float, waiting: float, idle: float) -> None:
        """One window's figures: ``waiting`` thread-seconds per second runnable but not running,
        ``idle`` cores idle on average."""
        if waiting > WAIT_SHARE and self.threads > 1:
            fewer = max(1, self.threads - max(1, round(waiting)))
            if now - self._last_up < FLAP_S:
                self._retry_s = min(MAX_RETRY_S, self._retry_s * 2)
            elif now - self._last_up > CALM_S:
                self._retry_s = RETRY_S
            self._last_down, self._free_windows = now, 0
            log.warning(
                "the cores are busy elsewhere (this worker's threads waited %.2f s per second to run): "
                "steps compute on %d thread(s) instead of %d, all again within %.0f s",
                waiting,
                fewer,
                self.threads,
                self._retry_s,
            )
            self._apply(fewer)
            return
        if self.threads == self.most:
            return
        missing = self.most - self.threads
        self._free_windows = self._free_windows + 1 if idle >= FREE_CORES * missing else 0
        if self._free_windows >= UP_WINDOWS or now - self._last_down >= self._retry_s:
            why = "the cores are free again" if self._free_windows >= UP_WINDOWS else "a retry"
            self._last_up, self._free_windows = now, 0
            log.info("%s (%.2f idle): steps compute on %d threads", why, idle, self.most)
            self._apply(self.most)

    def _apply(self, threads: int) -> None:
        self.threads = threads
        self.changes += 1
        self._set(threads)


def proc_readings(cpus: set[int] | None = None) -> Callable[[], Readings] | None:
    """The real :class:`Readings` of this process from Linux's ``/proc`` (each thread's ``schedstat``:
    nanoseconds on a core, nanoseconds runnable waiting for one; idle: the ``idle`` and ``iowait`` columns of ``/proc/stat``
    for ``cpus``, by default the cores this process may run on, in clock ticks). None when they
    cannot be read (no ``/proc``, a kernel without schedstats)."""
    cores = cpus if cpus is not None else os.sched_getaffinity(0)
    names = {f"cpu{c}" for c in cores}
    tick = os.sysconf("SC_CLK_TCK")

    def read() -> Readings:
        threads = {}
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/schedstat") as f:
                    ran, waited = f.read().split()[:2]
            except (OSError, ValueError):
                continue  # a thread that ended meanwhile
            threads[int(task)] = (int(ran) / 1e9, int(waited) / 1e9)
        idle = 0
        with open("/proc/stat") as f:
            for line in f:
                cols = line.split()
                if cols and cols[0] in names:
                    idle += int(cols[4]) + int(cols[5])
        return Readings(threads=threads, idle_s=idle / tick)

    try:
        read()
    except (OSError, IndexError, ValueError):
        return None
    return read


def governor_for(most: int, adapt: bool, on_gpu: bool, tensor_parallel: bool) -> ThreadGovernor | None:
    """The governor of a CPU worker computing on ``most`` threads, setting torch's thread count; None
    where nothing is governed: ``workers.adapt_threads`` off, a GPU (its threads only launch kernels),
    tensor parallel (every rank must step on the same schedule; each rank's process keeps its
    cores), a single thread, or no ``/proc`` to read."""
    if not adapt or on_gpu or tensor_parallel or most < 2 or (read := proc_readings()) is None:
        return None
    import torch

    return ThreadGovernor(most, read, torch.set_num_threads)
