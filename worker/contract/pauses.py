"""Where a pause a streaming client sees comes from: slow turns of a serving loop, logged with the
CPU the process used meanwhile.

A chat stream pauses when the engine loop takes no step (a long step, a slow message to handle) or
when the router's event loop relays nothing (a blocking call, a collection). Either process may also
simply not run: on a box with fewer cores than busy threads the kernel's scheduler hands the cores
to others. Wall time alone cannot tell these apart; the process's CPU time over the same turn can
(a computing turn uses about its threads' share of the wall time, a descheduled or blocked one almost
none). :class:`TurnWatch` times turns by both clocks and logs a turn over its threshold, naming what
the turn did. Stdlib only: the worker's engine loop and the router's event loop both use it
(Node.js calls the router's figure event-loop lag, ``monitorEventLoopDelay``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

SLOW_TURN_S = 0.25  # a turn this long is a pause a streaming client sees (a chunked step's budget is far below)


class TurnWatch:
    """Times one loop's turns (``clock``: wall seconds, ``cpu``: this process's CPU seconds, all
    threads) and logs each over ``slow_s`` as a warning: ``what`` took N ms of wall time and M ms of
    CPU, and the details :meth:`end` was given. Counts them in :attr:`slow_turns`; the longest in
    :attr:`longest_s`. One thread's loop per watch."""

    def __init__(
        self,
        what: str,
        slow_s: float = SLOW_TURN_S,
        clock: Callable[[], float] = time.perf_counter,
        cpu: Callable[[], float] = time.process_time,
    ):
        self.what, self.slow_s, self.clock, self.cpu = what, slow_s, clock, cpu
        self.slow_turns = 0
        self.longest_s = 0.0
        self._wall = self._cpu = 0.0

    def begin(self) -> None:
        """A turn starts now."""
        self._wall, self._cpu = self.clock(), self.cpu()

    def end(self, details: Callable[[], str] | None = None) -> float:
        """The turn begun by :meth:`begin` ends now: returns its wall seconds, logs it when slow
        (``details``, called only then: what the turn did, in words)."""
        wall = self.clock() - self._wall
        if wall > self.longest_s:
            self.longest_s = wall
        if wall > self.slow_s:
            self.slow_turns += 1
            used = self.cpu() - self._cpu
            log.warning(
                "%s took %.0f ms (%.0f ms of CPU: %s)%s",
                self.what,
                1e3 * wall,
                1e3 * used,
                cause(wall, used),
                f": {details()}" if details is not None else "",
            )
        return wall


def cause(wall_s: float, cpu_s: float) -> str:
    """What a slow turn's two clocks say: ``computing`` when the process used at least half a core
    over the turn, else ``waiting or not scheduled`` (blocked on I/O or a lock, or the cores were
    busy with other processes)."""
    return "computing" if cpu_s >= 0.5 * wall_s else "waiting or not scheduled"
