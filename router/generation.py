"""Driving one generation across workers: dispatch, relay, retry on worker loss, cancel.

``stream_tokens`` yields the worker's :class:`~worker.protocol.Tokens` events in order. If the
worker is lost (or leaves while shutting down) before any text reached the client, the request is
sent again to another ready worker (waiting for a restarted one when none is ready), up to
``max_retries`` times; after that, or once text has
been delivered, the loss surfaces as :class:`UpstreamError` (502). With ``buffered=True`` (a
non-streaming request: the client sees nothing until the end) the attempt's deltas are merged into
one final event, so a loss can be retried however far the lost attempt had got. Whatever way the
caller stops iterating (finish, error, timeout, client gone), the request is cancelled on the
worker and released from the pool's accounting.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator, Callable

from router.errors import ApiError
from router.workers import NoWorker, State, Worker, WorkerLost, WorkerPool
from worker.protocol import Failed, Generate, SamplingParams, Tokens

log = logging.getLogger(__name__)


class UpstreamError(ApiError):
    """The worker failed the request or was lost mid-way (502 unless the worker gave a status)."""


class _Retry(Exception):
    """This attempt's worker was lost and the request may go to another one."""


RETRY_WAIT_S = 60.0  # how long a retry waits for a worker to come back when none is ready
COMING_BACK = (State.STARTING, State.DEAD)  # states a supervised worker leaves by itself


async def _choose(pool: WorkerPool, tried: set[int], last_loss: str) -> Worker:
    """The worker for this attempt. A retry prefers a worker not tried yet; when no worker is ready
    at all (one replica, just killed) it waits, up to ``RETRY_WAIT_S`` and within the request's
    own timeout, for a restarting one to rejoin. Raises ``UpstreamError`` (502) when none can."""
    try:
        return pool.pick(exclude=tried, admitting=not tried)
    except NoWorker:
        if not tried:
            raise
    deadline = time.monotonic() + RETRY_WAIT_S
    while True:
        try:
            return pool.pick(admitting=False)  # a worker already tried may be back (restarted)
        except NoWorker:
            if time.monotonic() > deadline or not any(w.state in COMING_BACK for w in pool.workers.values()):
                raise UpstreamError(502, f"{last_loss}; no worker came back to retry on", code="worker_lost") from None
        await asyncio.sleep(0.25)


async def stream_tokens(pool: WorkerPool, prompt: list[int], params: SamplingParams, max_retries: int,
                        request_tag: str = "", buffered: bool = False,
                        on_tokens: Callable[[int, Tokens], None] | None = None) -> AsyncIterator[Tokens]:
    """``on_tokens(worker_id, event)`` sees every worker event as it arrives (metrics timing)."""
    tried: set[int] = set()
    delivered = False  # text reached the client: no retry from here on
    last_loss = ""  # why the previous attempt ended
    for attempt in range(max_retries + 1):
        worker = await _choose(pool, tried, last_loss)
        rid = pool.new_request_id()
        log.info("request %s -> worker %d as %s (%d prompt tokens)", request_tag, worker.worker_id, rid, len(prompt))
        queue = pool.register(worker, rid)
        finished = False  # the worker is done with it: no Cancel needed
        ok = False
        parts: list[str] = []
        ids: list[int] = []
        ttft: float | None = None
        try:
            await pool.send_generate(worker, Generate(request_id=rid, prompt_token_ids=prompt, params=params,
                                                      http_request_id=request_tag))
            while True:
                event = await queue.get()
                if isinstance(event, Tokens):
                    if on_tokens is not None:
                        on_tokens(worker.worker_id, event)
                    finished = ok = event.finish_reason is not None
                    if buffered:
                        parts.append(event.text_delta)
                        ids.extend(event.token_ids)
                        ttft = ttft if event.ttft_s is None else event.ttft_s
                        if not finished:
                            continue
                        event = Tokens(request_id=rid, text_delta="".join(parts), token_ids=ids,
                                       finish_reason=event.finish_reason, usage=event.usage, ttft_s=ttft)
                    delivered = delivered or bool(event.text_delta) or finished
                    yield event
                    if finished:
                        return
                    continue
                lost = isinstance(event, WorkerLost) or (isinstance(event, Failed) and event.code == 503)
                message = str(event) if isinstance(event, WorkerLost) else event.message
                if lost and not delivered and attempt < max_retries:
                    log.warning("request %s: %s; retrying on another worker (%d/%d)", request_tag, message,
                                attempt + 1, max_retries)
                    last_loss = message
                    raise _Retry
                if isinstance(event, Failed) and not lost:
                    finished = True
                    retry_after = {"Retry-After": "1"} if event.code == 429 else None
                    raise UpstreamError(event.code, message, code="worker_error", headers=retry_after)
                raise UpstreamError(502, f"{message}; the request could not be completed", code="worker_lost")
        except _Retry:
            pass
        finally:
            if not finished:
                await pool.cancel(rid)
            pool.finish(rid, ok=ok)
        tried.add(worker.worker_id)
