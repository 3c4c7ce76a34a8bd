"""Who may connect to the router's ZeroMQ socket over ``tcp://``: CURVE with this deployment's keys.

:class:`CurveGate` makes the ROUTER socket a CURVE server with the router's key pair
(:func:`worker.contract.keys.server_keys`) and starts pyzmq's ZAP authenticator on the socket's context
with a credentials provider that accepts only the public keys made for this deployment's worker
slots. A monitor socket reports the handshakes that fail before ZAP is asked (a peer without
CURVE, or one that does not have the router's public key). A refused peer never gets an identity
on the socket, so it can neither register, nor send, nor receive; each refusal is logged at
WARNING with its reason, at most once per :data:`REFUSAL_LOG_EVERY_S` per kind (with a count of
the rest), because a refused peer reconnects every few hundred milliseconds.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils.monitor import parse_monitor_message

from worker.contract.env import KEYS_ENV
from worker.contract.keys import ServerKeys, server_keys

log = logging.getLogger(__name__)

REFUSAL_LOG_EVERY_S = 10.0
REREAD_S = 1.0  # an unknown key rereads the key folder at most this often (a slot added by apply)
FAILURES = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
PROTOCOL_REASONS = {
    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: "the peer does not use CURVE (it has no key)",
    zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: "CURVE handshake failed (the peer does not have the router's public key)",
}


class CurveGate:
    """CURVE server and ZAP authenticator for one ROUTER socket. :meth:`start` before the socket
    binds; :meth:`close` before its context terminates."""

    def __init__(self, ctx: zmq.asyncio.Context, keys: ServerKeys):
        self.keys = keys
        self.endpoint = ""
        self._auth = AsyncioAuthenticator(ctx, log=logging.getLogger(f"{__name__}.zap"))
        self._monitor: zmq.asyncio.Socket | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None
        self._reported: dict[str, tuple[float, int]] = {}  # kind -> (last logged, refusals not logged since)
        self.refused = 0  # refusals so far (ZAP and handshake)
        self._read_at = time.monotonic()  # when the worker keys were last read

    def start(self, sock: zmq.asyncio.Socket, endpoint: str) -> None:
        """Make ``sock`` a CURVE server that asks ZAP (the authenticator) about every client key."""
        self.endpoint = endpoint
        self._auth.start()  # binds the ZAP endpoint of this context before any peer can connect
        self._auth.configure_curve_callback(domain="*", credentials_provider=self)
        sock.curve_server = True
        sock.curve_publickey = self.keys.public
        sock.curve_secretkey = self.keys.secret
        self._sock = sock
        self._monitor = sock.get_monitor_socket(FAILURES)
        self._task = asyncio.create_task(self._watch(), name="zmq-curve-monitor")
        log.info(
            "workers connect on %s with CURVE: only the %d worker key(s) made for this deployment are accepted",
            endpoint,
            len(self.keys.workers),
        )

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP's question (the credentials provider): may the client with Z85 public ``key`` in?"""
        if key in self.keys.workers or self._reread(key):
            return True
        self._refuse(
            "zap",
            f"ZAP refused CURVE client key {key.decode(errors='replace')}: not one of this deployment's worker keys",
        )
        return False

    def _reread(self, key: bytes) -> bool:
        """Read the deployment's worker keys again (at most once per :data:`REREAD_S`): a slot an
        ``apply`` added has its key made after this router started. True when ``key`` is one now."""
        now = time.monotonic()
        if self.keys.folder is None or now - self._read_at < REREAD_S:
            return False
        self._read_at = now
        try:
            self.keys = server_keys({KEYS_ENV: str(self.keys.folder)})
        except (OSError, RuntimeError) as exc:
            log.warning("cannot read the worker keys again: %s", exc)
            return False
        return key in self.keys.workers

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
        self._auth.stop()

    async def _watch(self) -> None:
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                continue  # ZAP said no: logged with its reason by callback()
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                value = event["value"]
                self._refuse(f"protocol-{value}", PROTOCOL_REASONS.get(value, f"ZMTP protocol error {value:#x}"))
            else:
                self._refuse(
                    "closed",
                    "the peer closed the connection during the handshake "
                    "(a peer without CURVE or without this deployment's keys hangs up)",
                )

    def _refuse(self, kind: str, reason: str) -> None:
        self.refused += 1
        now = time.monotonic()
        last, quiet = self._reported.get(kind, (-math.inf, 0))
        if now - last < REFUSAL_LOG_EVERY_S:
            self._reported[kind] = (last, quiet + 1)
            return
        self._reported[kind] = (now, 0)
        more = f" ({quiet} more such refusals in the last {now - last:.0f}s)" if quiet else ""
        log.warning("refused a ZeroMQ peer on %s: %s%s", self.endpoint, reason, more)
