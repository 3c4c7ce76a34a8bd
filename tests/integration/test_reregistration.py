"""A restarted router learns its running workers again over a real ZeroMQ socket: the worker's
transport (a real I/O thread) answers ``Identify`` with its ``Hello`` and ``Ready``, and its
heartbeats carry the Heartbeat fields of whatever ``stats()`` the engine reports."""

from __future__ import annotations

import asyncio
import os
import queue

from router.workers import State, WorkerPool
from tests.helpers.deployment import wait_for_async
from worker.contract.protocol import PROTOCOL_VERSION, Hello, Ready
from worker.transport import Transport


def engine_stats() -> dict:
    # what an engine may add beyond the Heartbeat's fields must not break the heartbeat
    return {
        "running": 0,
        "waiting": 0,
        "kv_used_tokens": 0,
        "mem_bytes": 1,
        "steps": 42,
        "last_step_age_s": 0.5,
        "prefix_hit_tokens": 7,
        "kv_blocks_free": 3,
    }


def ready(pool: WorkerPool) -> bool:
    w = pool.workers.get(0)
    return w is not None and w.state == State.READY and w.heartbeat is not None


async def scenario(address: str) -> None:
    first = WorkerPool(address, "round_robin", heartbeat_timeout_s=10)
    await first.start()
    transport = Transport(address, 0, queue.SimpleQueue(), engine_stats, heartbeat_s=0.05)
    transport.start()
    try:
        transport.announce(
            Hello(
                protocol=PROTOCOL_VERSION,
                worker_id=0,
                pid=os.getpid(),
                device="cpu[0]",
                model="m",
                max_num_seqs=4,
                max_waiting=2,
            )
        )
        transport.announce(Ready(worker_id=0, load_seconds=1.0, kv_budget_tokens=100))
        await wait_for_async(lambda: ready(first), 10)
        hb = first.workers[0].heartbeat
        assert (hb.steps, hb.last_step_age_s, hb.mem_bytes) == (42, 0.5, 1)
        await first.close()  # the router goes away

        second = WorkerPool(address, "round_robin", heartbeat_timeout_s=10, restarts=1)  # and comes back
        await second.start()
        try:
            await wait_for_async(lambda: ready(second), 10)
            w = second.workers[0]
            assert (w.pid, w.max_num_seqs, w.max_waiting, w.kv_budget_tokens) == (os.getpid(), 4, 2, 100)
            assert second.table().router.restarts == 1
        finally:
            await second.close()
    finally:
        transport.stop()
        transport.join(timeout=5)


def test_a_restarted_router_has_its_running_workers_identify_again(tmp_path):
    asyncio.run(scenario(f"ipc://{tmp_path}/workers.ipc"))
