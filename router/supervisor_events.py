"""The router's end of the supervisor's event channel: typed events pushed as they happen.

The supervisor binds a ZeroMQ PULL socket (``ipc://`` in its run directory) and passes its address
as ``--events``; the router connects a PUSH socket to it and sends each
:class:`~router.admin_protocol.SupervisorEvent` (worker ready, worker declared dead, start
requested) as one msgpack frame. ZeroMQ queues frames while the supervisor is not reading (up to
``SEND_HWM``), so nothing the router says between two of the supervisor's loops is lost.
"""

from __future__ import annotations

import logging

import zmq

from router.admin_protocol import SupervisorEvent, encode_event

log = logging.getLogger(__name__)

SEND_HWM = 10_000  # frames queued for a supervisor that is not reading before new ones are dropped
LINGER_MS = 1000  # at close: how long queued events may still go out


class EventSender:
    """Sends the router's events to the supervisor at ``address``; ``send`` never blocks."""

    def __init__(self, address: str, ctx: zmq.Context | None = None):
        self.address = address
        self._sock = (ctx or zmq.Context.instance()).socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._sock.setsockopt(zmq.LINGER, LINGER_MS)
        self._sock.connect(address)

    def send(self, event: SupervisorEvent) -> None:
        """Queue ``event`` for the supervisor; a full queue drops it with a warning."""
        try:
            self._sock.send(encode_event(event), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("the supervisor does not read its events (%s): dropped %r", self.address, event)

    def close(self) -> None:
        self._sock.close()
