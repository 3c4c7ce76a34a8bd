"""The worker's ZeroMQ side: one I/O thread beside the engine loop.

The thread owns the DEALER socket (ZeroMQ sockets are single-threaded). Frames from the router are
schema-checked and put on ``inbox``; an invalid frame is logged and dropped. The engine sends
through :meth:`Transport.sender`, a PUSH socket on an ``inproc://`` pipe that this thread drains,
so the engine never blocks on the network. Heartbeats go out every ``heartbeat_s`` seconds with
the engine's current load (the fields of :class:`~worker.contract.protocol.Heartbeat` that ``stats()`` has).

Re-registration: :meth:`Transport.announce` sends ``Hello`` and ``Ready`` and keeps them; when a
restarted router, which does not know this worker, answers a frame with ``Identify``, this thread
sends them again, so the worker rejoins with its model loaded and nothing restarted. While no
router is there, frames that do not fit the socket's queue are dropped (they would be stale).

CURVE (any address but ``ipc://``): the DEALER is a CURVE client with this worker slot's keys
(:func:`worker.contract.keys.client_keys`). A failed CURVE handshake is silent in ZeroMQ (frames just
queue), so a monitor socket watches the first one and :meth:`Transport.wait_handshake` turns a
refusal, or no success within its deadline, into :class:`HandshakeFailed`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from worker.contract.env import KEYS_ENV
from worker.contract.keys import ClientKeys
from worker.contract.protocol import (
    Heartbeat,
    Hello,
    Identify,
    Msg,
    ProtocolError,
    Ready,
    decode_for_worker,
    encode,
    worker_identity,
)

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 256 * 2**20  # a Generate carries at most max_model_len prompt tokens (~5 bytes each)
SEND_HWM = 100_000  # frames queued for the router while it is away (a restart takes seconds)
HANDSHAKE_TIMEOUT_S = 30.0  # the router is up before workers start: its handshake takes milliseconds
HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
HEARTBEAT_FIELDS = frozenset(f.name for f in msgspec.structs.fields(Heartbeat)) - {"worker_id"}


class HandshakeFailed(RuntimeError):
    """This worker could not complete the CURVE handshake with the router; ``str()`` says why."""


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
    """I/O thread: DEALER to the router at ``address``, inbox of decoded messages, heartbeats.
    ``curve``: this worker's CURVE keys (the router's socket then accepts only known keys)."""

    def __init__(
        self,
        address: str,
        worker_id: int,
        inbox: queue.SimpleQueue,
        stats: Callable[[], dict],
        heartbeat_s: float,
        curve: ClientKeys | None = None,
    ):
        super().__init__(name=f"zmq-worker-{worker_id}", daemon=True)
        self.ctx = zmq.Context.instance()
        self.address = address
        self.worker_id = worker_id
        self.inbox = inbox
        self.stats = stats
        self.heartbeat_s = heartbeat_s
        self.pipe = f"inproc://outbox-{worker_id}"
        self._stopping = threading.Event()
        self._announced: queue.SimpleQueue = queue.SimpleQueue()  # Hello/Ready to send from this thread
        self.registration: dict[type, Msg] = {}  # the last Hello and Ready, sent again on Identify
        self.dropped = 0  # frames dropped because no router took them
        self.curve = curve
        self._handshake = threading.Event()  # set when the first CURVE handshake succeeded or was refused
        self._refusal = ""  # why the router refused it (set with _handshake)
        self._last_failure = ""  # the last handshake failure the socket reported
        self._pull = self.ctx.socket(zmq.PULL)
        self._pull.bind(self.pipe)  # bound before any Sender connects

    def sender(self) -> Sender:
        """A new PUSH handle for the calling thread."""
        return Sender(self.ctx, self.pipe)

    def stop(self) -> None:
        self._stopping.set()

    def announce(self, msg: Hello | Ready) -> None:
        """Send ``msg`` (from any thread) and keep it: it is sent again whenever the router asks
        who this worker is (``Identify``). ``Hello`` first, then ``Ready`` once loaded."""
        self._announced.put(msg)

    def wait_handshake(self, timeout_s: float) -> None:
        """Return once the CURVE handshake with the router has succeeded (at once without CURVE).
        Raises :class:`HandshakeFailed` when the router refuses this worker's key, or when no
        handshake succeeds within ``timeout_s`` seconds (a wrong router key, or no router)."""
        if self.curve is None:
            return
        done = self._handshake.wait(timeout_s)
        if done and not self._refusal:
            return
        why = self._refusal or (
            f"no CURVE handshake with the router at {self.address} within {timeout_s:.0f}s"
            + (f" ({self._last_failure})" if self._last_failure else "")
        )
        raise HandshakeFailed(
            f"{why}: this worker cannot register. Check that it has this deployment's CURVE keys "
            f"(the folder in {KEYS_ENV}, made by `llamadeploy up`) and that the router is up"
        )

    def heartbeat(self) -> Heartbeat:
        """The heartbeat for now: ``stats()`` keys that are Heartbeat fields (others are ignored)."""
        stats = self.stats()
        return Heartbeat(worker_id=self.worker_id, **{k: v for k, v in stats.items() if k in HEARTBEAT_FIELDS})

    def run(self) -> None:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, worker_identity(self.worker_id))
        dealer.setsockopt(zmq.LINGER, 2000)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        dealer.setsockopt(zmq.SNDHWM, SEND_HWM)
        monitor = self._curve_client(dealer) if self.curve is not None else None
        dealer.connect(self.address)
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        if monitor is not None:
            poller.register(monitor, zmq.POLLIN)
        next_beat = 0.0
        while True:
            events = dict(poller.poll(timeout=100))
            self._send_announced(dealer)
            if self._pull in events:
                while True:  # forward everything queued, then look at the socket again
                    try:
                        frame = self._pull.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._send(dealer, frame)
            if dealer in events:
                self._receive(dealer)
            if monitor is not None and monitor in events and self._watch_handshake(monitor):
                poller.unregister(monitor)
                dealer.disable_monitor()
                monitor.close(linger=0)
                monitor = None
            if self._stopping.is_set() and not events:
                break
            now = time.monotonic()
            if now >= next_beat:
                self._send(dealer, encode(self.heartbeat()))
                next_beat = now + self.heartbeat_s
        if monitor is not None:
            monitor.close(linger=0)
        dealer.close()
        self._pull.close()

    def _curve_client(self, dealer: zmq.Socket) -> zmq.Socket:
        """Make ``dealer`` a CURVE client; returns a monitor socket on its handshakes."""
        dealer.curve_publickey = self.curve.public
        dealer.curve_secretkey = self.curve.secret
        dealer.curve_serverkey = self.curve.server
        return dealer.get_monitor_socket(HANDSHAKE_EVENTS)

    def _watch_handshake(self, monitor: zmq.Socket) -> bool:
        """Read the monitor's events; True once the first handshake succeeded or was refused."""
        while True:
            try:
                event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return False
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                log.info("CURVE handshake with the router at %s succeeded", self.address)
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self._refusal = (
                    f"the router at {self.address} refused this worker's CURVE key (ZAP status {event['value']})"
                )
            else:  # a protocol error or a connection closed mid-handshake: ZeroMQ retries until the deadline
                detail = zmq.Event(event["value"]).name if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL else ""
                self._last_failure = f"last: {zmq.Event(kind).name} {detail}".strip()
                continue
            self._handshake.set()
            return True

    def _send(self, dealer: zmq.Socket, frame: bytes) -> None:
        try:
            dealer.send(frame, zmq.NOBLOCK)
        except zmq.Again:  # no router has taken frames for a while: drop rather than stall the engine
            self.dropped += 1
            if self.dropped in (1, 100) or self.dropped % 10_000 == 0:
                log.warning("no router is taking frames: dropped %d so far", self.dropped)

    def _send_announced(self, dealer: zmq.Socket) -> None:
        while True:
            try:
                msg = self._announced.get_nowait()
            except queue.Empty:
                return
            self.registration[type(msg)] = msg
            self._send(dealer, encode(msg))

    def _identify(self, dealer: zmq.Socket) -> None:
        """The router asked who we are: Hello again, and Ready if loaded."""
        self._send_announced(dealer)
        found = [self.registration[t] for t in (Hello, Ready) if t in self.registration]
        log.info("the router asked who this worker is: sending %s again", " and ".join(type(m).__name__ for m in found))
        for msg in found:
            self._send(dealer, encode(msg))

    def _receive(self, dealer: zmq.Socket) -> None:
        while True:
            try:
                frame = dealer.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode_for_worker(frame)
                if isinstance(msg, Identify):
                    self._identify(dealer)
                    continue
                self.inbox.put(msg)
            except ProtocolError as exc:
                log.warning("dropped an invalid frame from the router (%d bytes): %s", len(frame), exc)
            except Exception:  # never let one frame stop the I/O thread (and with it the heartbeats)
                log.exception("dropped a frame from the router (%d bytes) that failed to decode", len(frame))
