"""CURVE on the workers' tcp:// socket, over real sockets on 127.0.0.1: the router's real
WorkerPool (with its CurveGate) against raw DEALER sockets and the worker's real Transport.

A peer without this deployment's keys never gets through the handshake: the router logs the
refusal, its worker table stays as it was, and a ``Generate`` for that identity cannot be sent.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import queue
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from router.workers import State, WorkerPool
from tests.helpers.deployment import free_port, wait_for_async
from worker.contract.env import KEYS_ENV
from worker.contract.keys import ClientKeys, add_worker_keys, client_keys, make_keys, server_keys
from worker.contract.protocol import (
    PROTOCOL_VERSION,
    Generate,
    Hello,
    SamplingParams,
    decode_for_worker,
    encode,
    worker_identity,
)
from worker.transport import HandshakeFailed, Transport

HELLO = Hello(
    protocol=PROTOCOL_VERSION, worker_id=0, pid=os.getpid(), device="cpu[0]", model="m", max_num_seqs=1, max_waiting=0
)
GENERATE = Generate(request_id="req-1", prompt_token_ids=[1, 2], params=SamplingParams(max_tokens=1))


@pytest.fixture
def keys(tmp_path) -> dict[str, str]:
    return make_keys(tmp_path, [0])


def stranger() -> ClientKeys:
    """A key pair this deployment did not make, that knows the router's public key."""
    public, secret = zmq.curve_keypair()
    return ClientKeys(public, secret, b"")


def dealer(ctx: zmq.asyncio.Context, address: str, curve: ClientKeys | None) -> zmq.asyncio.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, worker_identity(0))  # it claims a real slot's identity
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = curve.public, curve.secret, curve.server
    sock.connect(address)
    return sock


def refusals(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "router.curve" and r.levelno == logging.WARNING]


async def refused_peer(keys: dict, curve: ClientKeys | None, caplog, *reasons: str) -> None:
    """Connect a DEALER with ``curve`` keys (None: no CURVE) as worker 0 and say Hello; the router
    must log a refusal with one of ``reasons`` and know no worker, and cannot send it a Generate."""
    address = f"tcp://127.0.0.1:{free_port()}"
    pool = WorkerPool(address, "round_robin", heartbeat_timeout_s=10, curve=server_keys(keys))
    await pool.start()
    ctx = zmq.asyncio.Context()
    sock = dealer(ctx, address, curve)
    try:
        try:  # a DEALER whose handshake failed may have no pipe to queue on: its Hello then never leaves
            await sock.send(encode(HELLO), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
        (refusal, *_) = await wait_for_async(lambda: refusals(caplog), 10, what="a refusal in the router's log")
        assert address in refusal and any(reason in refusal for reason in reasons), refusal
        assert pool.workers == {} and pool.table().workers == []  # its Hello never arrived
        with pytest.raises(zmq.ZMQError) as exc:  # the socket has no such peer: no Generate can reach it
            await asyncio.wait_for(pool.link.send(0, GENERATE), 10)  # raises at once; never waits
        assert exc.value.errno == errno.EHOSTUNREACH
        assert await sock.poll(0) == 0
    finally:
        sock.close()
        ctx.term()
        await pool.close()


def test_a_dealer_without_a_key_cannot_register_or_receive(keys, caplog):
    # Which side sees the mechanism mismatch first varies: the router, or the peer, which hangs up.
    asyncio.run(
        refused_peer(keys, None, caplog, "the peer does not use CURVE", "closed the connection during the handshake")
    )


def test_a_dealer_with_a_key_of_its_own_is_refused_by_zap(keys, caplog):
    intruder = stranger()
    curve = ClientKeys(intruder.public, intruder.secret, server_keys(keys).public)
    asyncio.run(refused_peer(keys, curve, caplog, f"ZAP refused CURVE client key {intruder.public.decode()}"))


def test_a_dealer_with_a_wrong_router_key_cannot_register(keys, caplog):
    own = client_keys(0, keys)
    curve = ClientKeys(own.public, own.secret, zmq.curve_keypair()[0])  # a slot's own pair, the wrong router key
    asyncio.run(refused_peer(keys, curve, caplog, "the peer does not have the router's public key"))


async def accepted_peer(keys: dict, slot: int = 0) -> None:
    """A DEALER with slot ``slot``'s keys (made before it connects) registers and receives."""
    address = f"tcp://127.0.0.1:{free_port()}"
    pool = WorkerPool(address, "round_robin", heartbeat_timeout_s=10, curve=server_keys(keys))
    await pool.start()
    if slot:
        add_worker_keys(Path(keys[KEYS_ENV]), slot)  # a slot an apply adds, after the router started
    ctx = zmq.asyncio.Context()
    sock = dealer(ctx, address, client_keys(slot, keys))
    try:
        try:  # a DEALER whose handshake failed may have no pipe to queue on: its Hello then never leaves
            await sock.send(encode(HELLO), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
        await wait_for_async(lambda: 0 in pool.workers, 10, what="worker 0 registered")
        assert pool.workers[0].state == State.STARTING and pool.workers[0].pid == os.getpid()
        await pool.link.send(0, GENERATE)
        async with asyncio.timeout(10):
            assert decode_for_worker(await sock.recv()) == GENERATE
        assert pool.link.gate.refused == 0
    finally:
        sock.close()
        ctx.term()
        await pool.close()


def test_the_slots_own_keys_register_and_receive_a_generate(keys):
    asyncio.run(accepted_peer(keys))


def test_a_slot_whose_keys_are_made_after_the_router_started_is_accepted(keys, monkeypatch):
    monkeypatch.setattr("router.curve.REREAD_S", 0.0)  # the router reads the key folder again at once
    asyncio.run(accepted_peer(keys, slot=5))


async def worker_handshake(keys: dict, curve: ClientKeys, timeout_s: float) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    pool = WorkerPool(address, "round_robin", heartbeat_timeout_s=10, curve=server_keys(keys))
    await pool.start()
    idle = {"running": 0, "waiting": 0, "kv_used_tokens": 0, "mem_bytes": 0}
    transport = Transport(address, 0, queue.SimpleQueue(), lambda: idle, heartbeat_s=0.05, curve=curve)
    transport.start()
    try:
        transport.announce(HELLO)
        try:
            await asyncio.to_thread(transport.wait_handshake, timeout_s)  # the router's loop keeps running
        except HandshakeFailed:
            assert pool.workers == {}
            raise
        await wait_for_async(lambda: 0 in pool.workers, 10, what="worker 0 registered")
    finally:
        transport.stop()
        await asyncio.to_thread(transport.join, 5)
        await pool.close()


def test_a_worker_with_its_keys_completes_the_handshake(keys):
    asyncio.run(worker_handshake(keys, client_keys(0, keys), 10))


def test_a_refused_worker_fails_its_registration_naming_the_curve_keys(keys):
    intruder = stranger()
    curve = ClientKeys(intruder.public, intruder.secret, server_keys(keys).public)
    with pytest.raises(HandshakeFailed, match=r"refused this worker's CURVE key.*LLAMADEPLOY_CURVE_KEYS"):
        asyncio.run(worker_handshake(keys, curve, 30))


def test_a_worker_with_a_wrong_router_key_fails_within_the_deadline(keys):
    own = client_keys(0, keys)
    curve = ClientKeys(own.public, own.secret, zmq.curve_keypair()[0])
    with pytest.raises(HandshakeFailed, match=r"no CURVE handshake with the router .* within 1s.*CURVE keys"):
        asyncio.run(worker_handshake(keys, curve, 1))
