"""Requests held for a replica of their model while none is ready but one is expected.

A request that finds no ready replica of its model is not answered ``503`` while the deployment
expects one to become ready (:meth:`router.workers.WorkerPool.expects`: a worker loading after a
crash, ``restart-worker``, a rolling ``apply``, a start in progress). It joins its model's queue
here and waits, in order of (its ``priority``, lower first as vLLM's; its arrival), until:

* a replica of its model is ready with room and it is at the head of the queue: it is dispatched
  (the next one is woken at once, so a queue empties as fast as the replica takes requests);
* no replica of its model is expected any more (failed past ``max_restarts``, removed by
  ``apply``), or the router stops accepting (shutting down): ``503`` at once;
* it has waited ``router.hold_s``: ``503`` with ``Retry-After``, as when nothing is expected.

A model's queue holds at most ``max_waiting`` requests (its ``workers.max_waiting``: what one of
its workers would queue); one more is answered ``503`` at once. The queue lives in the router
process: when that process dies its held requests' connections close with it (the client sees a
closed connection, as for any request in flight there), and on a graceful stop (SIGTERM,
``POST /admin/shutdown``) they are answered ``503`` with ``Retry-After`` at once.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

# router.hold_s's default: a replacement's load time with room to spare. A CPU replica of the
# default model loads in seconds, a 7B-13B GPU replica in 20-60 s from the page cache, a 70B one
# split over GPUs in 1-2 minutes; a held request also ends within router.request_timeout_s.
DEFAULT_HOLD_S = 120.0


@dataclass(eq=False)
class Held:
    """One held request: its model (None: the deployment's only one), priority, arrival order and
    arrival time (monotonic seconds)."""

    model: str | None
    priority: int
    seq: int
    since: float = field(default_factory=time.monotonic)

    @property
    def order(self) -> tuple[int, int]:
        """Its place in the queue: (priority, arrival), lowest first."""
        return (self.priority, self.seq)


Outcome = str  # "dispatched", "timeout" (hold_s passed), "unexpected" (no replica expected), "shutdown", "cancelled"


class HoldQueue:
    """The router's held requests, one queue per model; the only writer of them.

    ``limits(model) -> (hold_s, max_waiting)`` (seconds, requests) is read at each use, so a live
    settings change applies to the next request (the router binds it to ``router.hold_s`` and the
    model's ``workers.max_waiting``). ``on_leave(model, outcome, seconds)`` sees every request
    leave (the metrics)."""

    def __init__(self, limits: Callable[[str | None], tuple[float, int]] = lambda _m: (DEFAULT_HOLD_S, 64)):
        self.limits = limits
        self.on_leave: Callable[[str | None, Outcome, float], None] = lambda model, outcome, s: None
        self._queues: dict[str | None, list[Held]] = {}
        self._seq = itertools.count()

    def join(self, model: str | None, priority: int = 0) -> Held | None:
        """Add a request to ``model``'s queue; None when the queue is full (``max_waiting``)."""
        queue = self._queues.setdefault(model, [])
        if len(queue) >= self.limits(model)[1]:
            return None
        entry = Held(model, priority, next(self._seq))
        queue.append(entry)
        return entry

    def is_head(self, entry: Held) -> bool:
        """``entry`` is first in its model's queue: the one to dispatch next."""
        queue = self._queues.get(entry.model, [])
        return bool(queue) and min(queue, key=lambda h: h.order) is entry

    def hold_s(self, model: str | None) -> float:
        """How long a request for ``model`` may be held (seconds)."""
        return self.limits(model)[0]

    def deadline(self, entry: Held) -> float:
        """When ``entry``'s hold ends (monotonic seconds)."""
        return entry.since + self.hold_s(entry.model)

    def leave(self, entry: Held, outcome: Outcome) -> float:
        """Remove ``entry`` (once; later calls do nothing); returns the seconds it was held."""
        queue = self._queues.get(entry.model, [])
        held = time.monotonic() - entry.since
        if entry in queue:
            queue.remove(entry)
            if not queue:
                del self._queues[entry.model]
            self.on_leave(entry.model, outcome, held)
        return held

    def waiting(self, model: str | None = None) -> int:
        """Requests held for ``model`` (None: the one-model queue)."""
        return len(self._queues.get(model, []))

    def by_model(self) -> dict[str, int]:
        """Requests held now per model (``""``: the one-model queue), for metrics and the status page."""
        return {model or "": len(queue) for model, queue in self._queues.items()}

    def oldest_s(self) -> dict[str, float]:
        """Seconds the longest-held request of each model has waited so far."""
        now = time.monotonic()
        return {model or "": round(now - min(h.since for h in q), 2) for model, q in self._queues.items() if q}
