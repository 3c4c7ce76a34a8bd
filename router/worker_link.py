"""The router's ZeroMQ link to its workers: one ROUTER socket, bound here, that workers connect to.

Each worker connects a DEALER whose identity is ``worker-<id>`` (stable across restarts, so a
restarted worker takes over its slot at once: ``ROUTER_HANDOVER``). One receive task reads every
frame and checks what the socket alone can: the sender's identity and the message's schema
(:func:`worker.contract.protocol.decode_for_router`); frames over :data:`MAX_FRAME_BYTES` disconnect the
peer. Anything else is logged and dropped, never executed. A valid message goes to ``on_message``
(the worker table, :class:`router.workers.WorkerPool`), which judges what it means. With ``curve``
keys (any address but ``ipc://``), only this deployment's workers get through the handshake
(:class:`router.curve.CurveGate`).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable

import zmq
import zmq.asyncio

from router.curve import CurveGate
from worker.contract.keys import ServerKeys
from worker.contract.protocol import Msg, ProtocolError, WorkerToRouter, decode_for_router, encode, worker_identity

log = logging.getLogger(__name__)

WORKER_IDENTITY = re.compile(rb"worker-([0-9]{1,6})")
MAX_FRAME_BYTES = 16 * 2**20  # worker -> router messages are small (token deltas, heartbeats)
LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")


class WorkerLink:
    """Owns the ROUTER socket at ``address``. ``on_message(worker_id, msg)`` gets every frame that
    passed the checks; :meth:`send` raises ``zmq.ZMQError`` when the worker is not connected.
    ``curve``: the socket is a CURVE server that accepts only these workers' keys."""

    def __init__(
        self, address: str, on_message: Callable[[int, WorkerToRouter], None], curve: ServerKeys | None = None
    ):
        self.address = address
        self.on_message = on_message
        self.ctx = zmq.asyncio.Context()
        self.gate = CurveGate(self.ctx, curve) if curve is not None else None
        self.sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to an absent worker raises, not drops
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted worker takes over its identity at once
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)  # a peer sending more is disconnected
        if self.gate is not None:
            self.gate.start(self.sock, self.address)
        self.sock.bind(self.address)  # a restarted router binds the same address (ipc: the path is reused)
        host = self.address.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
        if self.address.startswith("tcp://") and host not in LOOPBACK_HOSTS and self.gate is None:
            log.warning(
                "workers connect on %s without CURVE: any host that can reach it can act as a worker "
                "(keep it on a private network or use loopback)",
                self.address,
            )
        self._task = asyncio.create_task(self._receive(), name="zmq-receive")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.gate is not None:
            await self.gate.close()
        if self.sock is not None:
            self.sock.close()
        self.ctx.term()

    async def send(self, worker_id: int, msg: Msg) -> None:
        await self.sock.send_multipart([worker_identity(worker_id), encode(msg)])

    async def _receive(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            if len(frames) != 2:
                log.warning("dropped a message of %d frames", len(frames))
                continue
            identity, frame = frames
            try:
                self.dispatch(identity, frame)
            except Exception:  # never let one frame stop the receive loop
                log.exception("dropped a frame from %r that failed in handling", identity[:32])

    def dispatch(self, identity: bytes, frame: bytes) -> None:
        """Check one frame's sender and schema; hand a valid message on, log and drop the rest."""
        match = WORKER_IDENTITY.fullmatch(identity)
        if match is None:
            log.warning("dropped a frame from unknown peer %r (%d bytes)", identity[:32], len(frame))
            return
        try:
            msg = decode_for_router(frame)
        except ProtocolError as exc:
            log.warning("dropped an invalid frame from %r (%d bytes): %s", identity, len(frame), exc)
            return
        self.on_message(int(match.group(1)), msg)
