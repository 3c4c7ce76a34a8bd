"""The batch runner: the one loop that works through the batches in the store.

At most ``router.batch.running`` lines are in flight at once, oldest batch first, each answered
in process (:mod:`router.batch.lines`) at flex priority, so colleagues' interactive requests go
first. A line's answer is recorded with :meth:`Store.finish_line` (answer and done mark in one
transaction); a line the deployment could not answer now (429, 502, 503, 504: a worker lost past
its retries) runs again after a back-off, up to :data:`ATTEMPTS` times, before its error is its
answer; while no worker is ready (one restarting) no line starts, and a try that found none does
not count. A batch whose lines are all done is finalized (its output and error files
written with its status in one transaction); one past its completion window is ``expired`` and
one asked to cancel is ``cancelled``, their lines not done answered with an error line each.

Durability: nothing is kept only in memory but the lines in flight. A router that dies (``kill
-9``, failover, ``llamadeploy down``) loses those; the next router's runner finds them not done
and runs them again, so every line is answered exactly once in the output. Only one runner works
at a time: it holds an exclusive ``flock`` on the state folder's ``runner.lock`` (the kernel
releases it when the process dies, however it dies), which a new router's runner waits for.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import time
from pathlib import Path

from aiohttp import web

from router.batch.lines import answer
from router.batch.objects import line_request_id, unanswered_line
from router.batch.store import Line, Store
from router.state import API

log = logging.getLogger(__name__)

TICK_S = 1.0  # how often the runner looks at the store without being woken
ATTEMPTS = 5  # tries of a line the deployment could not answer (429, 5xx from a lost worker)
CLEANUP_EVERY_S = 3600.0
ENDINGS = {
    "expired": ("batch_expired", "This request could not be executed before the completion window expired."),
    "cancelled": ("batch_cancelled", "This request was not executed: the batch was cancelled."),
}


class Runner:
    """Runs the store's batches for ``app`` (whose :class:`~router.state.Api` it dispatches
    through); ``lock_path``: the file whose lock makes it the only runner."""

    def __init__(self, store: Store, app: web.Application, lock_path: Path):
        self.store, self.app, self.lock_path = store, app, lock_path
        self._wake = asyncio.Event()
        self._running: dict[tuple[str, int], asyncio.Task] = {}
        self._later: dict[tuple[str, int], float] = {}  # line -> when it may run again (time.monotonic())
        self._tries: dict[tuple[str, int], int] = {}  # line -> tries that found a worker ready and failed
        self._lock_fd: int | None = None
        self._cleaned = 0.0

    def wake(self) -> None:
        """Look at the store now (a batch was created or asked to cancel)."""
        self._wake.set()

    async def run(self) -> None:
        """Take the lock, then work until cancelled (the app's cleanup)."""
        try:
            await self._take_lock()
            while True:
                try:
                    await self._step()
                except Exception:  # a bad batch or a full disk must not stop the others for good
                    log.exception("batch runner step failed")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), TICK_S)
                self._wake.clear()
        finally:
            for task in self._running.values():
                task.cancel()
            if self._lock_fd is not None:
                os.close(self._lock_fd)

    async def _take_lock(self) -> None:
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._lock_fd = fd
                return
            except BlockingIOError:
                await asyncio.sleep(TICK_S)  # another router's runner (one being replaced) still works

    async def _step(self) -> None:
        now = time.time()
        if now - self._cleaned > CLEANUP_EVERY_S:
            self._cleaned = now
            self._cleanup(now)
        for row in self.store.active():
            bid, status = row["id"], row["status"]
            if status == "validating":
                self.store.set_status(bid, "in_progress", int(now))
            elif status == "cancelling":
                await self._end(bid, "cancelled")
            elif status == "finalizing":
                await asyncio.to_thread(self.store.finalize, bid, "completed", int(time.time()))
            elif now >= row["expires_at"]:
                await self._end(bid, "expired")
            elif not self._fill(bid):
                self.store.set_status(bid, "finalizing", int(now))
                await asyncio.to_thread(self.store.finalize, bid, "completed", int(time.time()))

    def _mine(self, bid: str) -> list[tuple[str, int]]:
        """The lines of ``bid`` in flight or waiting for a retry."""
        return [key for key in (*self._running, *self._later) if key[0] == bid]

    def _fill(self, bid: str) -> bool:
        """Start lines of ``bid`` while slots are free; False when every line of it is done (none
        left to run, in flight or waiting for a retry)."""
        free = self.app[API].cfg.router.batch.running - len(self._running) if self._serving() else 0
        if free > 0:
            due = [key for key, when in self._later.items() if key[0] == bid and when <= time.monotonic()]
            for key in due:
                self._later.pop(key)
            busy = {idx for _, idx in self._mine(bid)}
            for line in self.store.pending(bid, free, busy):
                self._start(line)
        return bool(self._mine(bid)) or self.store.undone(bid) > 0

    def _serving(self) -> bool:
        """Some worker is ready and the router takes requests: lines may start."""
        pool = self.app[API].pool
        return pool.accepting and bool(pool.ready_workers())

    def _start(self, line: Line) -> None:
        key = (line.batch_id, line.idx)
        endpoint = self.store.batch(None, line.batch_id)["endpoint"]
        task = asyncio.create_task(self._line(line, endpoint), name=f"batch-line-{line.batch_id}-{line.idx}")
        self._running[key] = task

    async def _line(self, line: Line, endpoint: str) -> None:
        key = (line.batch_id, line.idx)
        try:
            got = await answer(self.app, endpoint, line)
            # a try while no worker was ready (one restarting) does not count: the line waits for it
            tries = self._tries.get(key, 0) + (1 if self._serving() else 0)
            if got.transient and tries < ATTEMPTS:
                log.warning("batch %s line %d: %d; trying again (%d/%d)", *key, got.status, tries, ATTEMPTS)
                self._later[key] = time.monotonic() + min(2.0**tries, 30.0)
                self._tries[key] = tries
            else:
                self.store.finish_line(line, got.ok, got.text)
                self._tries.pop(key, None)
        finally:
            self._running.pop(key, None)
            self.wake()

    async def _end(self, bid: str, status: str) -> None:
        """Stop ``bid``'s lines in flight, answer those not done with an error line, finalize as ``status``."""
        tasks = [self._running[key] for key in self._mine(bid) if key in self._running]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for key in self._mine(bid):
            self._later.pop(key, None)
            self._tries.pop(key, None)
        code, message = ENDINGS[status]

        def result_of(line: Line) -> str:
            return unanswered_line(line_request_id(line), line.custom_id, code, message)

        await asyncio.to_thread(self.store.close_pending, bid, result_of)
        await asyncio.to_thread(self.store.finalize, bid, status, int(time.time()))
        log.info("batch %s %s", bid, status)

    def _cleanup(self, now: float) -> None:
        retention = self.app[API].cfg.router.batch.retention_days * 86400
        files, batches = self.store.cleanup(int(now - retention))
        if files or batches:
            log.info("batch retention: deleted %d file(s) and %d batch(es)", files, batches)
