"""The supervisor's end of the router's event channel (:mod:`router.supervisor_events`).

A ZeroMQ PULL socket bound in the run directory; the router (and each router that replaces it)
connects to it. :meth:`EventInbox.wait` is what the supervisor's loop blocks on between its steps:
it returns as soon as an event arrives, so a worker the router declares dead is killed, and a
requested start happens, at once rather than at the next poll.
"""

from __future__ import annotations

import logging
from pathlib import Path

import zmq

from router.admin_protocol import Event, decode_event

log = logging.getLogger(__name__)


class EventInbox:
    """The router's events for this supervisor, decoded (a frame that breaks the contract is
    logged at WARNING and dropped)."""

    def __init__(self, run_dir: Path, ctx: zmq.Context | None = None):
        self.address = f"ipc://{run_dir}/events.ipc"
        self._sock = (ctx or zmq.Context.instance()).socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.address)

    def wait(self, timeout_s: float) -> list[Event]:
        """Every event that has arrived, waiting up to ``timeout_s`` seconds for the first."""
        events: list[Event] = []
        if not self._sock.poll(max(0, int(timeout_s * 1000))):
            return events
        while True:
            try:
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return events
            try:
                events.append(decode_event(frame))
            except ValueError as exc:  # msgspec's DecodeError and ValidationError
                log.warning("dropped an event from the router that breaks the contract: %s", exc)

    def close(self) -> None:
        self._sock.close()
