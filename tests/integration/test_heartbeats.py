"""The router counts the heartbeats it accepts (``/workers`` shows them) over a real ZeroMQ socket,
and a heartbeat from one peer claiming another worker's id is refused, not counted."""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio

from router.workers import WorkerPool
from tests.helpers.deployment import wait_for_async
from worker.contract.protocol import PROTOCOL_VERSION, Heartbeat, Hello, encode, worker_identity


def heartbeat(wid: int, running: int) -> bytes:
    return encode(Heartbeat(worker_id=wid, running=running, waiting=0, kv_used_tokens=0, mem_bytes=0))


async def exchange(address: str, refused) -> None:
    pool = WorkerPool(address, "round_robin", heartbeat_timeout_s=10)
    await pool.start()
    peers = []
    try:
        for identity in (worker_identity(0), worker_identity(99)):
            s = pool.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.IDENTITY, identity)
            s.connect(address)
            peers.append(s)
        real, stranger = peers
        await real.send(
            encode(
                Hello(
                    protocol=PROTOCOL_VERSION,
                    worker_id=0,
                    pid=1,
                    device="cpu",
                    model="m",
                    max_num_seqs=8,
                    max_waiting=8,
                )
            )
        )
        await wait_for_async(lambda: 0 in pool.workers, 10)
        assert pool.workers[0].heartbeats == 0
        await real.send(heartbeat(0, running=1))
        await wait_for_async(lambda: pool.workers[0].heartbeats == 1, 10)

        await stranger.send(heartbeat(0, running=99))  # forged: worker-99 claims to be worker 0
        await wait_for_async(lambda: refused() or pool.workers[0].heartbeats > 1, 10)
        w = pool.workers[0]
        assert (w.heartbeats, w.heartbeat.running) == (1, 1)
        assert 99 not in pool.workers
    finally:
        for s in peers:
            s.close()
        await pool.close()


def test_heartbeats_are_counted_and_a_forged_one_is_refused(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="router.workers")
    asyncio.run(
        exchange(
            f"ipc://{tmp_path}/router.sock",
            lambda: "dropped Heartbeat claiming worker 0 from identity b'worker-99'" in caplog.text,
        )
    )
