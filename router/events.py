"""The router's recent worker events, for the status page: a bounded, in-memory log.

Fed where the worker table changes (:class:`router.workers.WorkerPool`: a state change, a process
the supervisor started) and where a request moves (:mod:`router.generation`: a migration). It keeps
the last :data:`MAX_EVENTS` and starts empty with each router process (a router restart loses it,
as it loses the worker table). Nothing here decides anything: it only records.
"""

from __future__ import annotations

import collections
import itertools
import time
from dataclasses import asdict, dataclass

from router.admin_protocol import WorkerState

MAX_EVENTS = 200


@dataclass(frozen=True)
class Event:
    """One thing that happened to a worker slot. ``ts``: Unix seconds; ``kind``: ``started``,
    ``restarted``, ``ready``, ``draining``, ``undrained``, ``died``, ``failed``, ``stopped`` or
    ``migrated``; ``detail``: one line for a person (the reason a process died, a pid, ...)."""

    seq: int
    ts: float
    worker_id: int
    kind: str
    detail: str


# What entering a state is called in the log (``starting`` is logged from the process start instead).
_KIND_OF_STATE = {
    WorkerState.DRAINING: "draining",
    WorkerState.DEAD: "died",
    WorkerState.FAILED: "failed",
    WorkerState.STOPPED: "stopped",
}


class EventLog:
    """The last ``size`` events, oldest first; ``seq`` numbers them so a poller can ask for the new ones."""

    def __init__(self, size: int = MAX_EVENTS):
        self._events: collections.deque[Event] = collections.deque(maxlen=size)
        self._seq = itertools.count(1)

    def add(self, worker_id: int, kind: str, detail: str = "") -> Event:
        event = Event(next(self._seq), time.time(), worker_id, kind, detail)
        self._events.append(event)
        return event

    def state_changed(
        self, worker_id: int, old: WorkerState, new: WorkerState, reason: str = "", load_seconds: float = 0.0
    ) -> None:
        """A slot moved from ``old`` to ``new``. ``reason``: why its process ended (for dead, failed,
        stopped); ``load_seconds``: its start to ready (for ready)."""
        if new == WorkerState.READY and old == WorkerState.DRAINING:
            self.add(worker_id, "undrained", "routing to it again")
        elif new == WorkerState.READY:
            self.add(worker_id, "ready", f"loaded in {load_seconds:.1f}s" if load_seconds else "")
        elif (kind := _KIND_OF_STATE.get(new)) is not None:
            self.add(worker_id, kind, reason if new != WorkerState.DRAINING else "no new requests")

    def process_started(self, worker_id: int, pid: int, restarts: int) -> None:
        """The supervisor started a process for the slot: its first, or restart number ``restarts``."""
        if restarts:
            self.add(worker_id, "restarted", f"pid {pid}, restart {restarts}")
        else:
            self.add(worker_id, "started", f"pid {pid}")

    def migrated(self, from_worker: int, to_worker: int, tokens: int, why: str) -> None:
        """A request moved from ``from_worker`` to ``to_worker`` after ``tokens`` generated tokens."""
        self.add(from_worker, "migrated", f"a request moved to worker {to_worker} after {tokens} tokens ({why})")

    def recent(self, limit: int = MAX_EVENTS) -> list[dict]:
        """The last ``limit`` events, newest first, as JSON-ready dicts."""
        return [asdict(e) for e in itertools.islice(reversed(self._events), limit)]
