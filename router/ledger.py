"""The router's load accounting: which requests are in flight on which worker, and how many each
worker has served or failed. :class:`Ledger` is the only writer of a slot's ``requests``,
``served`` and ``failed_requests`` (:class:`router.slot.Worker`); what ``least_loaded`` counts as
a worker's load is what it wrote here the moment a request was dispatched."""

from __future__ import annotations

from router.slot import RouterRequest, Worker


class Ledger:
    """The requests in flight, by id and by the worker that owns each. Pure bookkeeping on the
    router's event loop: no I/O, no locks."""

    def __init__(self) -> None:
        self._by_id: dict[str, RouterRequest] = {}

    def register(self, worker: Worker, request_id: str) -> RouterRequest:
        """Count ``request_id`` against ``worker`` at once; returns its record, whose ``events`` the
        caller reads. The caller must :meth:`finish` it on every path."""
        req = RouterRequest(request_id, worker)
        worker.requests[request_id] = req
        self._by_id[request_id] = req
        return req

    def finish(self, req: RouterRequest, ok: bool) -> bool:
        """Release the request and count it as served (``ok``) or failed on its worker; False when it
        was already released (every ending path calls this: done, error, cancel, timeout, loss)."""
        w = req.worker
        if w.requests.pop(req.request_id, None) is None:
            return False
        if self._by_id.get(req.request_id) is req:
            del self._by_id[req.request_id]
        if ok:
            w.served += 1
        else:
            w.failed_requests += 1
        return True

    def owner_of(self, request_id: str) -> RouterRequest | None:
        """The record of ``request_id``, whichever worker holds it (None: not in flight)."""
        return self._by_id.get(request_id)

    def in_flight(self) -> int:
        """Requests in flight on every worker together."""
        return len(self._by_id)
