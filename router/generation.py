"""Driving one generation across workers: dispatch, relay, retry on worker loss, cancel.

``stream_tokens`` yields the worker's :class:`~worker.protocol.Tokens` events in order. If the
worker is lost (or leaves while shutting down) before any text reached the caller, the request is
sent again to another ready worker, up to ``max_retries`` times; after that, or once text has
been delivered, the loss surfaces as :class:`UpstreamError`. Whatever way the caller stops
iterating (finish, error, timeout, client gone), the request is cancelled on the worker and
released from the pool's accounting.
"""

from __future__ import annotations

import logging
from typing import AsyncIterator

from router.errors import ApiError
from router.workers import NoWorker, WorkerLost, WorkerPool
from worker.protocol import Failed, Generate, SamplingParams, Tokens

log = logging.getLogger(__name__)


class UpstreamError(ApiError):
    """The worker failed the request or was lost mid-way (502 unless the worker gave a status)."""


async def stream_tokens(pool: WorkerPool, prompt: list[int], params: SamplingParams, max_retries: int,
                        request_tag: str = "") -> AsyncIterator[Tokens]:
    tried: set[int] = set()
    delivered = False
    attempt = 0
    while True:
        try:
            worker = pool.pick(exclude=tried)
        except NoWorker:
            if not tried:
                raise
            worker = pool.pick()  # only a worker we already tried is left (it may have restarted)
        rid = pool.new_request_id()
        log.info("request %s -> worker %d as %s (%d prompt tokens)", request_tag, worker.worker_id, rid, len(prompt))
        queue = await pool.submit(worker, Generate(request_id=rid, prompt_token_ids=prompt, params=params))
        finished = False  # the worker is done with it: no Cancel needed
        ok = False
        retry_reason = ""
        try:
            while True:
                event = await queue.get()
                if isinstance(event, Tokens):
                    delivered = delivered or bool(event.text_delta) or event.finish_reason is not None
                    finished = ok = event.finish_reason is not None
                    yield event
                    if finished:
                        return
                    continue
                lost = isinstance(event, WorkerLost) or (isinstance(event, Failed) and event.code == 503)
                message = str(event) if isinstance(event, WorkerLost) else event.message
                if lost and not delivered and attempt < max_retries:
                    retry_reason = message
                    break
                if isinstance(event, Failed) and not lost:
                    finished = True
                    raise UpstreamError(event.code, message, code="worker_error")
                raise UpstreamError(502, f"{message}; the request could not be completed", code="worker_lost")
        finally:
            if not finished:
                await pool.cancel(rid)
            pool.finish(rid, ok=ok)
        attempt += 1
        tried.add(worker.worker_id)
        log.warning("request %s: %s; retrying on another worker (%d/%d)", request_tag, retry_reason, attempt, max_retries)
