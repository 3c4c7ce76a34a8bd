"""The hold suite's view of one replacement, from the router's worker table sampled every
:data:`SAMPLE_S`: when the old replica stopped serving, when the new process started, said Hello
and was ready.

The replacement time the suite holds its target against is the honest one for a held request:
from the moment the model had no ready replica (the old one stopped answering) until its
replacement is ready, since the router holds a request only while no replica of its model is
ready. It includes what a ``load_seconds`` leaves out: the supervisor's delay before the restart,
the new process's start and its imports. A surge (the replacement ready before the old one stops
serving) has a replacement time of 0: no request should wait.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

SAMPLE_S = 0.2  # how often the table is read


@dataclass(frozen=True)
class Replacement:
    """One replacement's times (monotonic seconds; None: not seen). ``stopped``: the first moment
    with no ready replica; ``spawned``: the new process in the table (the supervisor's start
    report); ``hello``: its Hello (the row's uptime counts from it); ``ready``: ready.
    ``load_s``: the replacement's own ``load_seconds`` (Hello to ready, as the worker counts it)."""

    stopped: float | None
    spawned: float | None
    hello: float | None
    ready: float | None
    load_s: float

    @property
    def down_s(self) -> float:
        """Seconds the model had no ready replica: stopped to ready (0 for a surge)."""
        if self.stopped is None or self.ready is None or self.ready < self.stopped:
            return 0.0
        return self.ready - self.stopped

    def parts(self) -> dict[str, float | None]:
        """``down_s`` split: the restart delay (stopped to the new process), the process's start
        and imports (to its Hello), the load (Hello to ready); None where a time was not seen or
        the part does not apply (a surge)."""

        def gap(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None or self.down_s == 0 else round(max(0.0, b - a), 2)

        return {
            "restart_delay_s": gap(self.stopped, self.spawned),
            "start_s": gap(self.spawned, self.hello),
            "load_s": gap(self.hello, self.ready),
        }


class ReplacementWatch:
    """Samples ``admin``'s worker table (an :class:`~launcher.supervise.admin_client.AdminClient`)
    in a thread, watching the replacement of the process ``old_pid``; the only writer of its times.
    ``stopped_at``: when the old one is known to have stopped answering (a ``kill -9``'s moment),
    earlier than the table can show it."""

    def __init__(self, admin, old_pid: int, stopped_at: float | None = None):
        self.admin, self.old_pid = admin, old_pid
        self.stopped, self.spawned, self.hello, self.ready = stopped_at, None, None, None
        self.load_s, self.old_gone = 0.0, False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ReplacementWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def mark_stopped(self, at: float) -> None:
        """The old replica stopped answering at ``at`` (the bench killed it)."""
        self.stopped = at if self.stopped is None else min(self.stopped, at)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            table = self.admin.try_table(timeout=5.0)
            if table is not None:
                self.observe(time.monotonic(), table.workers)

    def observe(self, now: float, rows: list) -> None:
        """One sample of the table's ``rows`` (:class:`~router.admin_protocol.WorkerInfo`) at ``now``."""
        if not any(w.state.value == "ready" for w in rows) and self.stopped is None:
            self.stopped = now
        new = [w for w in rows if w.pid and w.pid != self.old_pid]
        if new and self.spawned is None:
            self.spawned = now
        ready = [w for w in new if w.state.value == "ready"]
        if ready and self.ready is None:  # a ready row's uptime counts from its Hello
            self.ready, self.load_s = now, ready[0].load_seconds
            self.hello = now - ready[0].uptime_s
        self.old_gone = self.old_gone or all(w.pid != self.old_pid for w in rows)

    def wait(self, timeout: float) -> Replacement:
        """Until the replacement is ready and the old process gone from the table; its times.
        RuntimeError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not (self.ready is not None and self.old_gone):
            if time.monotonic() > deadline:
                raise RuntimeError(f"no replacement of pid {self.old_pid} ready within {timeout:.0f}s")
            time.sleep(SAMPLE_S)
        return Replacement(self.stopped, self.spawned, self.hello, self.ready, self.load_s)
