"""A router worker pool without sockets: frames go through the real decode path, sends are recorded."""

from __future__ import annotations

import asyncio

from router.workers import State, WorkerPool
from worker.contract.protocol import (
    PROTOCOL_VERSION,
    Generate,
    Hello,
    Ready,
    SamplingParams,
    Tokens,
    Usage,
    encode,
    worker_identity,
)


class RecordingPool(WorkerPool):
    def __init__(self) -> None:
        super().__init__("inproc://unused", "round_robin", heartbeat_timeout_s=10)
        self.sent: list[tuple[int, object]] = []

    async def _send(self, worker_id: int, msg) -> None:
        self.sent.append((worker_id, msg))

    def frame(self, wid: int, msg) -> None:
        self.link.dispatch(worker_identity(wid), encode(msg))

    def boot(self, wid: int, pid: int, restarts: int = 0, model: str = "m") -> None:
        """What a (re)start looks like to the router: the supervisor's report, Hello, Ready."""
        self.on_started(wid, pid, restarts, f"cpu[{wid}]", model)
        self.frame(
            wid,
            Hello(
                protocol=PROTOCOL_VERSION,
                worker_id=wid,
                pid=pid,
                device=f"cpu[{wid}]",
                model=model,
                max_num_seqs=8,
                max_waiting=8,
            ),
        )
        assert self.workers[wid].state == State.STARTING  # loading: never ready before Ready
        self.frame(wid, Ready(worker_id=wid, load_seconds=1.0, kv_budget_tokens=1000))

    def generates(self) -> list[tuple[int, Generate]]:
        return [(w, m) for w, m in self.sent if isinstance(m, Generate)]

    def tokens(self, text: str, finish: str | None = None) -> None:
        wid, gen = self.generates()[-1]
        usage = Usage(prompt_tokens=1, completion_tokens=len(text), total_tokens=1 + len(text)) if finish else None
        self.frame(
            wid, Tokens(request_id=gen.request_id, text_delta=text, token_ids=[1], finish_reason=finish, usage=usage)
        )

    def in_flight(self) -> int:
        return sum(w.in_flight for w in self.workers.values())


PARAMS = SamplingParams(max_tokens=10)


def run(coro):
    return asyncio.run(coro)


def two_workers() -> RecordingPool:
    pool = RecordingPool()
    pool.boot(0, pid=100)
    pool.boot(1, pid=101)
    return pool


async def step() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def collect(gen) -> list[Tokens]:
    return [t async for t in gen]


def say(pool: RecordingPool, text: str, ids: list[int], finish: str | None = None, total: int = 0) -> None:
    """The latest attempt's worker sends one delta (``total``: completion tokens in the final usage)."""
    wid, gen = pool.generates()[-1]
    usage = (
        Usage(
            prompt_tokens=len(gen.prompt_token_ids),
            completion_tokens=total,
            total_tokens=len(gen.prompt_token_ids) + total,
        )
        if finish
        else None
    )
    pool.frame(
        wid, Tokens(request_id=gen.request_id, text_delta=text, token_ids=ids, finish_reason=finish, usage=usage)
    )
