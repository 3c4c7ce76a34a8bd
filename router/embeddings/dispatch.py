"""One embeddings request's round trip to a worker, with retries when the worker is lost.

The request goes to a ready worker of the model as one :class:`~worker.contract.protocol.Embed`;
its answer comes back as :class:`~worker.contract.protocol.Embedded` messages (vectors in input
order) or a ``Failed``. Nothing reaches the client before the whole answer, so a lost worker
(process gone, silent, stalled, leaving) means a retry from the start on another or the restarted
worker, up to ``max_retries`` times (waiting for a restarting one as chat does); a worker's refusal
(429 with Retry-After, 400, 503 after a queue wait) is the client's answer. Whatever way the
caller stops waiting (finish, error, timeout, client gone), the request is cancelled on the worker
and released from the pool's accounting.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import zmq

from router.generation import UpstreamError, _choose, _failure, _is_departure
from router.workers import Worker, WorkerLost, WorkerPool
from worker.contract.protocol import Embed, Embedded, Failed

log = logging.getLogger(__name__)


@dataclass
class Vectors:
    """A finished request: one little-endian float32 byte string per input, and its tokens."""

    vectors: list[bytes]
    prompt_tokens: int


class _Lost(Exception):
    pass


async def embed(
    pool: WorkerPool, inputs: list[list[int]], max_retries: int, request_tag: str = "", model: str | None = None
) -> Vectors:
    """The vectors of ``inputs`` (token id lists) from a worker of ``model`` (a served name; None:
    any worker), across retries; raises :class:`UpstreamError`."""
    tried: set[int] = set()
    last_loss = ""
    while True:
        worker = await _choose(pool, tried, last_loss, None, model)
        try:
            return await _attempt(pool, worker, inputs, request_tag)
        except _Lost as loss:
            last_loss = str(loss)
            if len(tried) >= max_retries:
                raise UpstreamError(502, f"{loss}; the request could not be completed", code="worker_lost") from None
            log.warning("embeddings %s: %s; retrying (%d/%d)", request_tag, loss, len(tried) + 1, max_retries)
        tried.add(worker.worker_id)


async def _attempt(pool: WorkerPool, worker: Worker, inputs: list[list[int]], request_tag: str) -> Vectors:
    """One attempt on ``worker``: raises :class:`_Lost` when it goes, ``UpstreamError`` when it refuses."""
    rid = pool.new_request_id()
    # debug: at hundreds of requests a second the access log's line is enough
    log.debug("embeddings %s -> worker %d as %s (%d inputs)", request_tag, worker.worker_id, rid, len(inputs))
    req = pool.register(worker, rid)
    finished = ok = False
    vectors: list[bytes] = []
    try:
        try:
            await pool.send(req, Embed(request_id=rid, inputs=inputs, http_request_id=request_tag))
        except zmq.ZMQError:
            raise _Lost(f"worker {worker.worker_id} is unreachable") from None
        while True:
            event = await req.events.get()
            if isinstance(event, WorkerLost):
                raise _Lost(str(event))
            if isinstance(event, Failed):
                finished = not _is_departure(event)
                if not finished:
                    raise _Lost(event.message)
                raise _failure(event)
            if not isinstance(event, Embedded) or event.start != len(vectors):
                raise UpstreamError(502, f"worker {worker.worker_id} answered out of order", code="worker_error")
            vectors.extend(event.vectors)
            if event.last:
                finished = True
                if len(vectors) != len(inputs):
                    raise UpstreamError(
                        502,
                        f"worker {worker.worker_id} sent {len(vectors)} vectors for {len(inputs)} inputs",
                        code="worker_error",
                    )
                ok = True
                return Vectors(vectors, event.prompt_tokens)
    finally:
        if not finished:
            await pool.cancel(req)
        pool.finish(req, ok=ok)
