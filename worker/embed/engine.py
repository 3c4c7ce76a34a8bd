"""The embedding worker's engine: requests in, vectors out, batched across requests by tokens.

Each :meth:`EmbedEngine.step` asks the :class:`~worker.embed.batcher.Batcher` for this step's
inputs (round-robin over the queued requests within the token budget), runs them as micro-batches
sorted by length (:func:`~worker.embed.batcher.micro_batches`), and answers every request whose
last input was computed with :class:`~worker.contract.protocol.Embedded` (several messages for a
large answer). It is an :class:`~worker.core.EngineCore`, as the chat engine is: the loop in
:mod:`worker.main` speaks to both alike, and sends the messages their ``submit`` and ``step`` return.
"""

from __future__ import annotations

import logging
import time

import torch

from worker.contract.protocol import Embed, Embedded, EngineLoad, Msg
from worker.core import failed
from worker.embed.batcher import Batcher, EmbedJob, Item, QueueFull, micro_batches
from worker.embed.model import Embedder
from worker.engine import memory_bytes

log = logging.getLogger(__name__)

MAX_INPUTS = 2048  # inputs per request, as OpenAI's API allows
MESSAGE_BYTES = 8 * 2**20  # vector bytes per Embedded message, under the router link's frame limit


class EmbedEngine:
    """Owns the :class:`Embedder` and the batcher. Single-threaded; an :class:`~worker.core.EngineCore`."""

    def __init__(self, embedder: Embedder, batcher: Batcher):
        self.embedder = embedder
        self.batcher = batcher
        self.device = embedder.device
        self.served = 0
        self.steps = 0
        self.last_step_at = time.monotonic()
        self._last_inputs = 0

    @property
    def by_id(self) -> dict[str, EmbedJob]:
        """The requests held, by id (the loop fails them over when the worker leaves)."""
        return self.batcher.jobs

    def submit(self, msg: Embed) -> list[Msg]:
        """Queue a request; returns ``[Failed]`` when it is invalid or the queue is full."""
        rid = msg.request_id
        if rid in self.batcher.jobs:
            return [failed(rid, 400, "duplicate request_id")]
        if problem := self.check(msg.inputs):
            return [failed(rid, 400, problem)]
        try:
            self.batcher.add(EmbedJob(rid, msg.inputs))
        except QueueFull as exc:
            return [failed(rid, 429, str(exc), retry_after_s=1.0)]
        return []

    def check(self, inputs: list[list[int]]) -> str | None:
        """What is wrong with ``inputs`` (the router checks them first; this guards the model)."""
        spec, vocab = self.embedder.spec, self.embedder.vocab_size
        if not 1 <= len(inputs) <= MAX_INPUTS:
            return f"{len(inputs)} inputs: 1 to {MAX_INPUTS} expected"
        for i, ids in enumerate(inputs):
            if not 1 <= len(ids) <= spec.max_tokens:
                return f"input {i} has {len(ids)} tokens: 1 to {spec.max_tokens} expected"
            if min(ids) < 0 or max(ids) >= vocab:
                return f"input {i}: token ids must be in [0, {vocab})"
        return None

    def cancel(self, request_id: str) -> None:
        """Forget a request; its inputs already in a step are computed and dropped."""
        self.batcher.drop(request_id)

    @property
    def has_work(self) -> bool:
        return bool(self.batcher.jobs)

    def in_flight(self) -> list[str]:
        """The ids of every request held."""
        return list(self.batcher.jobs)

    def idle(self) -> None:
        """One process: nothing to keep alive."""

    def step(self) -> list[Msg]:
        """One step: expire what waited too long, compute this step's inputs, answer the finished.
        Returns the step's messages (``Embedded`` answers, ``Failed``)."""
        step = self.batcher.take()
        wait = self.batcher.max_queue_wait_s
        out: list[Msg] = [
            failed(job.request_id, 503, f"waited longer than {wait:g}s for its turn; retry later", 5.0)
            for job in step.expired
        ]
        for batch in micro_batches(step.items, self.batcher.token_budget):
            out += self._run(batch)
        self._last_inputs = len(step.items)
        self.steps += 1
        self.last_step_at = time.monotonic()
        return out

    def last_step(self) -> str:
        """The last step's inputs and the requests still queued."""
        return f"step {self.steps}: {self._last_inputs} inputs; {len(self.batcher.jobs)} requests held"

    def _run(self, batch: list[Item]) -> list[Msg]:
        """One forward pass over ``batch``; store the vectors, answer the requests now complete."""
        try:
            vectors = self.embedder.embed([item.ids for item in batch])
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            return self._fail_all(batch, 503, "out of device memory for this batch; retry later", 5.0)
        except RuntimeError as exc:
            log.exception("embedding forward pass failed")
            return self._fail_all(batch, 500, f"the forward pass failed: {exc}", None)
        out: list[Msg] = []
        for item, vector in zip(batch, vectors, strict=True):
            job = item.job
            if self.batcher.jobs.get(job.request_id) is not job:
                continue  # cancelled or failed meanwhile
            job.vectors[item.index] = vector.tobytes()
            job.done += 1
            if job.complete:
                self.batcher.drop(job.request_id)
                out += self._answer(job)
        return out

    def _answer(self, job: EmbedJob) -> list[Msg]:
        """``job``'s vectors in order, in messages of at most :data:`MESSAGE_BYTES`."""
        per = max(1, MESSAGE_BYTES // max(1, len(job.vectors[0])))
        out: list[Msg] = []
        for start in range(0, len(job.vectors), per):
            last = start + per >= len(job.vectors)
            out.append(
                Embedded(
                    request_id=job.request_id,
                    start=start,
                    vectors=job.vectors[start : start + per],
                    last=last,
                    prompt_tokens=job.tokens if last else 0,
                )
            )
        self.served += 1
        return out

    def _fail_all(self, batch: list[Item], code: int, message: str, retry_after_s: float | None) -> list[Msg]:
        jobs = {item.job for item in batch}
        return [
            failed(j.request_id, code, message, retry_after_s) for j in jobs if self.batcher.drop(j.request_id) is j
        ]

    def stats(self) -> EngineLoad:
        """This engine's figures now (the heartbeat's load)."""
        b = self.batcher
        return EngineLoad(
            running=b.running,
            waiting=b.waiting,
            peak_running=b.peak_running,
            finished=self.served,
            mem_bytes=memory_bytes(self.device),
            steps=self.steps,
            last_step_age_s=time.monotonic() - self.last_step_at,
            cpu_s=time.process_time(),  # a long step that computes is not a hung one (router.stall)
        )
