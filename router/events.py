"""The router's recent worker events, for the status page: a bounded, in-memory log.

Fed where the worker table changes (:class:`router.workers.WorkerPool`: a state change, a process
the supervisor started) and where a request moves (:mod:`router.generation`: a migration). It keeps
the last :data:`MAX_EVENTS`. With a ``path`` (the supervisor's run directory, which outlives each
router process) every event is also appended there, one JSON object a line, and a router that
replaces a dead one starts from that file: the log lives as long as the deployment, not the router.
Nothing here decides anything: it only records.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from router.admin_protocol import WorkerState

log = logging.getLogger(__name__)

MAX_EVENTS = 200
ROUTER = -1  # the worker_id of an event about the router itself


@dataclass(frozen=True)
class Event:
    """One thing that happened to a worker slot. ``ts``: Unix seconds; ``kind``: ``started``,
    ``restarted``, ``ready``, ``draining``, ``undrained``, ``died``, ``failed``, ``stopped`` or
    ``migrated`` (or ``router`` for the router itself, ``worker_id`` :data:`ROUTER`); ``detail``: one
    line for a person (the reason a process died, a pid, ...)."""

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
    """The last ``size`` events, oldest first; ``seq`` numbers them so a poller can ask for the new
    ones. ``path``: the file that keeps them across router processes (module docstring); it holds
    at most ``2 × size`` lines (rewritten with the last ``size`` when it reaches that)."""

    def __init__(self, size: int = MAX_EVENTS, path: Path | None = None):
        self._events: collections.deque[Event] = collections.deque(_read(path) if path else (), maxlen=size)
        self._path = path
        self._lines = len(self._events)  # in the file: rewritten (compacted) from the deque once it grows
        self._seq = itertools.count(self._events[-1].seq + 1 if self._events else 1)
        if path is not None:
            self._keep(None)  # the file compacted to what was loaded (a new one created)

    def add(self, worker_id: int, kind: str, detail: str = "") -> Event:
        event = Event(next(self._seq), time.time(), worker_id, kind, detail)
        self._events.append(event)
        if self._path is not None:
            self._keep(event)
        return event

    def _keep(self, event: Event | None) -> None:
        """Append ``event`` to the file (a line of a few hundred bytes, a few times a second at
        most: written in place, like a log line), or rewrite the file with the last ``size`` events
        (``None``, or a full file); a file that cannot be written is left, with a warning."""
        try:
            if event is None or self._lines >= 2 * (self._events.maxlen or MAX_EVENTS):
                self._rewrite()
            else:
                with self._path.open("a") as f:
                    f.write(_line(event))
                self._lines += 1
        except OSError as exc:
            log.warning("worker events are no longer kept in %s (%s); a router restart will lose them", self._path, exc)
            self._path = None

    def _rewrite(self) -> None:
        tmp = self._path.with_name(self._path.name + ".tmp")
        tmp.write_text("".join(map(_line, self._events)))
        tmp.replace(self._path)
        self._lines = len(self._events)

    def router_restarted(self, pid: int, restarts: int) -> None:
        """This router replaced a dead one (restart number ``restarts``): the workers re-register with
        it, which logs each one's start and ready again (the same processes)."""
        self.add(ROUTER, "router", f"router restarted (pid {pid}, restart {restarts}); the workers re-register")

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


def _line(event: Event) -> str:
    return json.dumps(asdict(event)) + "\n"


def _read(path: Path) -> list[Event]:
    """The events in ``path`` (none when it does not exist); a line that is not one (a router killed
    while writing it) is skipped."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    except OSError as exc:
        log.warning("cannot read the worker events kept in %s (%s); starting a new list", path, exc)
        return []
    events = []
    for line in lines:
        try:
            events.append(Event(**json.loads(line)))
        except (ValueError, TypeError):
            continue
    return events
