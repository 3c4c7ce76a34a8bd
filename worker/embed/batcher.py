"""Which inputs the embedding engine computes in each step: pure logic, no torch.

Requests queue in arrival order (FIFO). Each step takes inputs **round-robin over the queued
requests**: one input of each request in queue order, then a second of each that has more, ...,
until the step's token budget (the real tokens of the inputs taken) is spent; it always takes
at least one input. So a request of 2,048 inputs gets one input per round like a one-line request
beside it: the small requests finish within their first step and the large one advances every
step; neither starves. Inside a step the inputs are sorted by length and cut into micro-batches
whose padded size (inputs × the longest) stays within the budget, so padding to the longest wastes
little (:func:`micro_batches`).

Backpressure and deadlines as for chat: at most ``max_requests`` requests are held (:class:`QueueFull`
beyond, answered 429), and a request none of whose inputs was started within ``max_queue_wait_s``
expires (answered 503 with Retry-After).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


class QueueFull(Exception):
    """The engine already holds ``max_requests`` requests."""


@dataclass(eq=False)
class EmbedJob:
    """One request: its ``inputs`` (token ids each), the next input not yet scheduled, the vectors
    computed so far (``None`` until computed), and when it was queued (monotonic seconds)."""

    request_id: str
    inputs: list[list[int]]
    queued_at: float = field(default_factory=time.monotonic)
    next: int = 0
    vectors: list = field(default_factory=list)
    done: int = 0

    def __post_init__(self) -> None:
        self.vectors = [None] * len(self.inputs)

    @property
    def started(self) -> bool:
        return self.next > 0

    @property
    def complete(self) -> bool:
        return self.done == len(self.inputs)

    @property
    def tokens(self) -> int:
        return sum(map(len, self.inputs))


@dataclass(frozen=True)
class Item:
    """Input ``index`` of ``job``."""

    job: EmbedJob
    index: int

    @property
    def ids(self) -> list[int]:
        return self.job.inputs[self.index]


@dataclass
class Step:
    """One step's inputs (in the order taken) and the requests that expired waiting."""

    items: list[Item]
    expired: list[EmbedJob]


class Batcher:
    """The queue of :class:`EmbedJob` and the choice of each step's inputs (module docstring).

    ``token_budget``: real tokens per step (at least the longest input allowed, so one input always
    fits a micro-batch); ``max_requests``: requests held at once; ``clock``: monotonic seconds."""

    def __init__(
        self,
        token_budget: int,
        max_requests: int,
        max_queue_wait_s: float = float("inf"),
        clock: Callable[[], float] = time.monotonic,
    ):
        if token_budget < 1 or max_requests < 1:
            raise ValueError("token_budget and max_requests must be >= 1")
        self.token_budget = token_budget
        self.max_requests = max_requests
        self.max_queue_wait_s = max_queue_wait_s
        self.clock = clock
        self.jobs: dict[str, EmbedJob] = {}  # insertion order is arrival order
        self.peak_running = 0

    def add(self, job: EmbedJob) -> None:
        """Queue ``job``; raises :class:`QueueFull` when ``max_requests`` are held."""
        if len(self.jobs) >= self.max_requests:
            raise QueueFull(
                f"the worker holds {len(self.jobs)} requests, its limit (workers.max_num_seqs + max_waiting)"
            )
        job.queued_at = self.clock()
        self.jobs[job.request_id] = job

    def drop(self, request_id: str) -> EmbedJob | None:
        """Forget a request (cancelled, finished or failed); its inputs in flight are discarded."""
        return self.jobs.pop(request_id, None)

    @property
    def running(self) -> int:
        """Requests with an input started (read by the heartbeat thread too: it copies the queue
        first, which the engine thread may change meanwhile)."""
        return sum(j.started for j in list(self.jobs.values()))

    @property
    def waiting(self) -> int:
        """Requests none of whose inputs started yet."""
        return sum(not j.started for j in list(self.jobs.values()))

    def take(self) -> Step:
        """This step's inputs, round-robin over the queue within the token budget, and the
        requests that expired before any of their inputs started (dropped from the queue)."""
        now = self.clock()
        expired = [j for j in self.jobs.values() if not j.started and now - j.queued_at > self.max_queue_wait_s]
        for job in expired:
            del self.jobs[job.request_id]
        items: list[Item] = []
        spent = 0
        pending = [j for j in self.jobs.values() if j.next < len(j.inputs)]
        while pending:
            for job in pending:
                cost = len(job.inputs[job.next])
                if items and spent + cost > self.token_budget:
                    return self._taken(items, expired)
                items.append(Item(job, job.next))
                job.next += 1
                spent += cost
            pending = [j for j in pending if j.next < len(j.inputs)]
        return self._taken(items, expired)

    def _taken(self, items: list[Item], expired: list[EmbedJob]) -> Step:
        self.peak_running = max(self.peak_running, self.running)
        return Step(items, expired)


def micro_batches(items: list[Item], token_budget: int) -> list[list[Item]]:
    """``items`` sorted by length (shortest first) and cut so that each batch padded to its longest
    input holds at most ``token_budget`` tokens (a single longer input is a batch of its own)."""
    batches: list[list[Item]] = []
    current: list[Item] = []
    for item in sorted(items, key=lambda i: len(i.ids)):
        if current and (len(current) + 1) * len(item.ids) > token_budget:
            batches.append(current)
            current = []
        current.append(item)
    if current:
        batches.append(current)
    return batches
