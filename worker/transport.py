"""The worker's ZeroMQ side: one I/O thread beside the engine loop.

The thread owns the DEALER socket (ZeroMQ sockets are single-threaded). Frames from the router are
schema-checked and put on ``inbox``; an invalid frame is logged and dropped. The engine sends
through :meth:`Transport.sender`, a PUSH socket on an ``inproc://`` pipe that this thread drains,
so the engine never blocks on the network. Heartbeats go out every ``heartbeat_s`` seconds with
the engine's current load.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

import zmq

from worker.protocol import Heartbeat, Msg, ProtocolError, decode_for_worker, encode, worker_identity

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 256 * 2**20  # a Generate carries at most max_model_len prompt tokens (~5 bytes each)


class Sender:
    """Engine-side handle: ``send(msg)`` queues a message for the router (never blocks long)."""

    def __init__(self, ctx: zmq.Context, pipe: str):
        self._sock = ctx.socket(zmq.PUSH)
        self._sock.connect(pipe)

    def send(self, msg: Msg) -> None:
        self._sock.send(encode(msg))

    def close(self) -> None:
        self._sock.close(linger=1000)


class Transport(threading.Thread):
    """I/O thread: DEALER to the router at ``address``, inbox of decoded messages, heartbeats."""

    def __init__(self, address: str, worker_id: int, inbox: queue.SimpleQueue, stats: Callable[[], dict],
                 heartbeat_s: float):
        super().__init__(name=f"zmq-worker-{worker_id}", daemon=True)
        self.ctx = zmq.Context.instance()
        self.address = address
        self.worker_id = worker_id
        self.inbox = inbox
        self.stats = stats
        self.heartbeat_s = heartbeat_s
        self.pipe = f"inproc://outbox-{worker_id}"
        self._stopping = threading.Event()
        self._pull = self.ctx.socket(zmq.PULL)
        self._pull.bind(self.pipe)  # bound before any Sender connects

    def sender(self) -> Sender:
        """A new PUSH handle for the calling thread."""
        return Sender(self.ctx, self.pipe)

    def stop(self) -> None:
        self._stopping.set()

    def run(self) -> None:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, worker_identity(self.worker_id))
        dealer.setsockopt(zmq.LINGER, 2000)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        dealer.connect(self.address)
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        next_beat = 0.0
        while True:
            events = dict(poller.poll(timeout=100))
            if self._pull in events:
                while True:  # forward everything queued, then look at the socket again
                    try:
                        dealer.send(self._pull.recv(zmq.NOBLOCK))
                    except zmq.Again:
                        break
            if dealer in events:
                self._receive(dealer)
            if self._stopping.is_set() and not events:
                break
            now = time.monotonic()
            if now >= next_beat:
                dealer.send(encode(Heartbeat(worker_id=self.worker_id, **self.stats())))
                next_beat = now + self.heartbeat_s
        dealer.close()
        self._pull.close()

    def _receive(self, dealer: zmq.Socket) -> None:
        while True:
            try:
                frame = dealer.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self.inbox.put(decode_for_worker(frame))
            except ProtocolError as exc:
                log.warning("dropped an invalid frame from the router (%d bytes): %s", len(frame), exc)
            except Exception:  # never let one frame stop the I/O thread (and with it the heartbeats)
                log.exception("dropped a frame from the router (%d bytes) that failed to decode", len(frame))
