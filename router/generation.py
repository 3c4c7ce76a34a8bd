"""Driving one generation across workers: dispatch, relay, retry and migration on worker loss, cancel.

``stream_tokens`` yields the worker's :class:`~worker.contract.protocol.Tokens` events in order. When the
worker serving it is lost (process gone, silent, stalled, or leaving while shutting down):

* **Migration**, once tokens were generated: the same prompt and parameters go to another ready
  worker with ``Generate.output_token_ids`` = every token id generated so far. The worker takes
  them as context, replays them through its detokenizer and stop matcher without sending their
  text again (it was delivered), and generates only the rest of ``max_tokens``; its final
  ``usage`` counts the prompt and all generated tokens once. So the client's stream goes on with
  no duplicated text, no gap and one ``finish_reason``. Up to ``max_migrations`` moves per request.
  Prompt logprobs (echo) come from the first attempt that sent them; the new worker, which
  recomputes the prompt anyway, scores it again and that copy is dropped.
* **Retry** from the start, when nothing was generated yet (or, for a request whose client has seen
  nothing, when no migration is left), up to ``max_retries`` times.
* Otherwise the loss surfaces as :class:`UpstreamError` (502): an error event once a stream started.

A new request that finds no ready worker is held until one is (:mod:`router.hold`); a retry or a
migration waits for a restarting worker when none is ready (:func:`_choose`). With ``buffered=True`` (a
non-streaming request: the client sees nothing until the end) the deltas of every attempt are
merged into one final event. Whatever way the caller stops iterating (finish, error, timeout,
client gone), the request is cancelled on the worker and released from the pool's accounting.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

import msgspec

from router.errors import ApiError
from router.tiers import INTERACTIVE, Urgency
from router.workers import NoWorker, Overloaded, Worker, WorkerLost, WorkerPool
from worker.contract.protocol import Failed, Generate, SamplingParams, Tokens

log = logging.getLogger(__name__)

CONTINUATION = {  # what a migration promises, by workers.deterministic
    True: "greedy and seeded text continues as undisturbed",
    False: "the continuation is valid, not necessarily the undisturbed text (workers.deterministic is off)",
}


class UpstreamError(ApiError):
    """The worker failed the request or was lost mid-way (502 unless the worker gave a status)."""


class _Lost(Exception):
    """This attempt's worker was lost; ``reason`` is a metric label, ``message`` says what happened."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason, self.message = reason, message


SHUTTING_DOWN = 503  # a worker's Failed code when it leaves with the request in flight


async def _choose(
    pool: WorkerPool,
    tried: set[int],
    last_loss: str,
    prompt: list[int] | None,
    model: str | None = None,
    priority: int = 0,
) -> Worker:
    """The worker for this attempt, one of ``model``'s replicas (None: any). A first attempt that
    finds none ready is held (:func:`_hold`) while one is expected. A retry (or a migration)
    prefers a worker not tried yet; when none is ready at all (one replica, just killed) it waits
    while one is expected, up to ``router.hold_s`` and within the request's own timeout, for a
    restarting one to rejoin (one with no room yet: until it has room). Raises ``UpstreamError``
    (502) when none can."""
    try:
        return pool.pick(exclude=tried, admitting=not tried, prompt=prompt, model=model)
    except NoWorker:
        if not tried:
            if not pool.accepting or pool.hold.hold_s(model) <= 0 or not pool.expects(model):
                raise
            return await _hold(pool, prompt, model, priority)
    deadline = time.monotonic() + pool.hold.hold_s(model)
    while True:
        try:
            return pool.pick(admitting=False, prompt=prompt, model=model)  # a worker tried may be back (restarted)
        except (NoWorker, Overloaded) as exc:
            left = deadline - time.monotonic()
            if isinstance(exc, NoWorker) and (left <= 0 or not pool.expects(model)):
                raise UpstreamError(502, f"{last_loss}; no worker came back to retry on", code="worker_lost") from None
            if left <= 0:
                raise
        await pool.wait_change(left)  # a worker's state changed: it may be ready now


async def _hold(pool: WorkerPool, prompt: list[int] | None, model: str | None, priority: int) -> Worker:
    """Wait in ``model``'s hold queue (:mod:`router.hold`) for a ready replica with room; return it
    once this request is first in line. Raises ``NoWorker`` (503, ``Retry-After``) when the queue
    is full, the hold time passes, no replica is expected any more or the router shuts down."""
    hold = pool.hold
    entry = hold.join(model, priority)
    whose = "" if model is None else f" of model '{model}'"
    if entry is None:
        raise NoWorker(f"no worker{whose} is ready and {hold.waiting(model)} requests already wait for one")
    outcome = "cancelled"
    try:
        while True:
            if not pool.accepting:
                outcome = "shutdown"
                raise NoWorker("the server is shutting down")
            if hold.is_head(entry):
                try:
                    worker = pool.pick(prompt=prompt, model=model)
                    outcome = "dispatched"
                    return worker
                except (NoWorker, Overloaded):
                    pass  # not ready yet, or ready and full: wait for the next change
            if not pool.expects(model):
                outcome = "unexpected"
                raise NoWorker(f"no worker{whose} is ready and none is expected to be")
            left = hold.deadline(entry) - time.monotonic()
            if left <= 0:
                outcome = "timeout"
                raise NoWorker(f"no worker{whose} became ready within {hold.hold_s(model):.0f}s (router.hold_s)")
            await pool.wait_change(left)
    finally:
        held = hold.leave(entry, outcome)
        pool.notify()  # the next in line may go now
        if outcome == "dispatched":
            log.info("request held %.2fs for a worker%s", held, whose)


@dataclass
class _Progress:
    """What one request has got so far, across its attempts, and what it may still spend."""

    max_retries: int
    max_migrations: int
    ids: list[int] = field(default_factory=list)  # every token id generated (a migration's context)
    parts: list[str] = field(default_factory=list)  # text not yet handed on (buffered requests)
    ttft: float | None = None
    logprobs: list = field(default_factory=list)  # TokenLogprob of every token, when asked (buffered requests)
    prompt_logprobs: list | None = None  # the prompt's, from the first attempt that sent them
    delivered: bool = False  # text reached the client: a restart from scratch would duplicate it
    retries: int = 0
    migrations: int = 0

    def merged(self, last: Tokens) -> Tokens:
        """One event with everything received, ending like ``last`` (buffered requests)."""
        return Tokens(
            request_id=last.request_id,
            text_delta="".join(self.parts),
            token_ids=list(self.ids),
            finish_reason=last.finish_reason,
            usage=last.usage,
            ttft_s=self.ttft,
            logprobs=self.logprobs if last.logprobs is not None or self.logprobs else None,
            prompt_logprobs=self.prompt_logprobs,
        )

    def take(self, event: Tokens, buffered: bool) -> Tokens | None:
        """Record a worker's event; returns what to hand on (None: a buffered request keeps it for
        its one final event)."""
        finished = event.finish_reason is not None
        self.ids.extend(event.token_ids)
        if event.prompt_logprobs is not None:
            if self.prompt_logprobs is None:
                self.prompt_logprobs = event.prompt_logprobs
            else:  # a migrated attempt scored the prompt again: the client has them already
                event = msgspec.structs.replace(event, prompt_logprobs=None)
        if buffered:
            self.parts.append(event.text_delta)
            self.ttft = self.ttft if event.ttft_s is None else event.ttft_s
            self.logprobs.extend(event.logprobs or [])
            if not finished:
                return None
            event = self.merged(event)
        self.delivered = self.delivered or bool(event.text_delta) or finished
        return event

    def after_loss(self, loss: _Lost, request_tag: str) -> bool:
        """Decide what a lost attempt becomes: True to migrate, False to retry from the start (what
        was received is dropped). Raises :class:`UpstreamError` (502) when neither is left."""
        if self.ids and self.migrations < self.max_migrations:
            self.migrations += 1
            return True
        if not self.delivered and self.retries < self.max_retries:
            self.retries += 1
            log.warning(
                "request %s: %s; retrying on another worker (%d/%d)",
                request_tag,
                loss.message,
                self.retries,
                self.max_retries,
            )
            self.ids, self.parts, self.ttft = [], [], None  # nothing of it reached the client
            self.logprobs, self.prompt_logprobs = [], None
            return False
        moved = f" after {self.migrations} migration(s)" if self.migrations else ""
        raise UpstreamError(502, f"{loss.message}; the request could not be completed{moved}", code="worker_lost")


async def stream_tokens(
    pool: WorkerPool,
    prompt: list[int],
    params: SamplingParams,
    max_retries: int,
    request_tag: str = "",
    buffered: bool = False,
    on_tokens: Callable[[int, Tokens], None] | None = None,
    max_migrations: int = 0,
    on_migration: Callable[[str], None] | None = None,
    model: str | None = None,
    urgency: Urgency = INTERACTIVE,
    exact: bool = False,
) -> AsyncIterator[Tokens]:
    """The request's events, across retries and migrations (see the module docstring), on
    ``model``'s replicas (a served name; None: any worker), each attempt carrying ``urgency``
    (its ``priority`` and ``flex``: :mod:`router.tiers`); its ``priority`` (vLLM's: lower first)
    also orders the request among those held for a replica (:mod:`router.hold`).

    ``on_tokens(worker_id, event)`` sees every worker event as it arrives (metrics timing);
    ``on_migration(reason)`` is called for each move, ``reason`` a bounded label (``exited``,
    ``heartbeat_timeout``, ``stalled``, ``shutting_down``, ...). ``exact``: the workers are
    batch-invariant (``workers.deterministic``), so a migrated greedy or seeded stream goes on with the
    undisturbed text; the migration's log line says which it promises."""
    tried: set[int] = set()
    got = _Progress(max_retries, max_migrations)
    moving: tuple[int, _Lost] | None = None  # (from worker, why) while a migration finds its worker
    last_loss = ""  # why the previous attempt ended
    while True:
        worker = await _choose(pool, tried, last_loss, prompt, model, urgency.priority)
        if moving is not None:
            log.warning(
                "request %s: migrating from worker %d to worker %d after %d tokens (%s; %d/%d); %s",
                request_tag,
                moving[0],
                worker.worker_id,
                len(got.ids),
                moving[1].message,
                got.migrations,
                max_migrations,
                CONTINUATION[exact],
            )
            pool.events.migrated(moving[0], worker.worker_id, len(got.ids), moving[1].message)
        try:
            async with aclosing(
                _attempt(pool, worker, prompt, params, request_tag, got, buffered, on_tokens, urgency)
            ) as events:
                async for event in events:
                    yield event
            return
        except _Lost as loss:
            last_loss = loss.message
            moving = (worker.worker_id, loss) if got.after_loss(loss, request_tag) else None
            if moving is not None and on_migration is not None:
                on_migration(loss.reason)
        tried.add(worker.worker_id)


def _is_departure(event: Failed) -> bool:
    """A 503 without ``retry_after_s``: the worker is leaving with the request in flight (it moves)."""
    return event.code == SHUTTING_DOWN and event.retry_after_s is None


def _failure(event: Failed) -> Exception:
    """What a worker's ``Failed`` becomes: :class:`_Lost` when the worker is leaving, else the
    worker's status as :class:`UpstreamError` (``Retry-After`` when it refused for capacity)."""
    if _is_departure(event):
        return _Lost("shutting_down", event.message)
    wait = event.retry_after_s if event.retry_after_s is not None else 1 if event.code == 429 else None
    retry_after = {"Retry-After": str(max(1, round(wait)))} if wait is not None else None
    return UpstreamError(event.code, event.message, code="worker_error", headers=retry_after)


async def _attempt(
    pool: WorkerPool,
    worker: Worker,
    prompt: list[int],
    params: SamplingParams,
    request_tag: str,
    got: _Progress,
    buffered: bool,
    on_tokens: Callable[[int, Tokens], None] | None,
    urgency: Urgency = INTERACTIVE,
) -> AsyncIterator[Tokens]:
    """One attempt on ``worker``, resuming after ``got.ids``: yields events until the finish;
    raises :class:`_Lost` when the worker goes, :class:`UpstreamError` when it fails the request."""
    rid = pool.new_request_id()
    log.info(
        "request %s -> worker %d as %s (%d prompt tokens%s)",
        request_tag,
        worker.worker_id,
        rid,
        len(prompt),
        f", resuming after {len(got.ids)} generated" if got.ids else "",
    )
    req = pool.register(worker, rid)
    finished = ok = False  # finished: the worker is done with it, no Cancel needed
    try:
        await pool.send_generate(
            req,
            Generate(
                request_id=rid,
                prompt_token_ids=prompt,
                params=params,
                http_request_id=request_tag,
                output_token_ids=list(got.ids),
                priority=urgency.priority,
                flex=urgency.flex,
            ),
        )
        while True:
            event = await req.events.get()
            if isinstance(event, WorkerLost):
                raise _Lost(event.reason, str(event))
            if isinstance(event, Failed):
                finished = not _is_departure(event)
                raise _failure(event)
            if on_tokens is not None:
                on_tokens(worker.worker_id, event)
            finished = ok = event.finish_reason is not None
            handed = got.take(event, buffered)
            if handed is not None:
                yield handed
            if finished:
                return
    finally:
        if not finished:
            await pool.cancel(req)
        pool.finish(req, ok=ok)
