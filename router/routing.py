"""Where a request is scheduled: which worker of the table gets it.

:class:`Routing` narrows the table to the candidates (``ready``, not excluded, of the request's
model, with room for one more request) and asks the routing policy in force
(:mod:`router.policies`), one instance per served model (its own rotation, its own cache-affinity
table, over its own replicas). It tells that policy what follows a pick: the request dispatched,
finished, a worker's process gone. It is the only writer of which policy is in force.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from router.admin_protocol import WorkerState
from router.errors import ApiError
from router.policies.base import Policy, Routed
from router.policies.registry import make_policy
from router.slot import RouterRequest, Worker


class Overloaded(ApiError):
    """429: every candidate worker holds as many requests as its batch and waiting queue."""

    def __init__(self) -> None:
        super().__init__(
            429, "every worker's queue is full; retry later", code="overloaded", headers={"Retry-After": "1"}
        )


class NoWorker(ApiError):
    """503: no worker (of the request's model) is ready, or the router is shutting down."""

    def __init__(self, why: str = "no worker is ready") -> None:
        super().__init__(503, why, code="no_ready_worker", headers={"Retry-After": "5"})


class Routing:
    """The routing policy in force (``policy``: a name in :data:`router.policies.registry.POLICIES`)
    and its instance per served model."""

    def __init__(self, policy: str) -> None:
        self.policy: Policy = make_policy(policy)  # the one-model path's instance (no model named)
        self._by_model: dict[str, Policy] = {}

    @property
    def name(self) -> str:
        return self.policy.name

    def set_policy(self, name: str) -> None:
        """Route by policy ``name`` from now on: fresh instances, with no state of the old policy's.
        Raises ``KeyError`` for an unknown name."""
        self.policy, self._by_model = make_policy(name), {}

    def for_model(self, model: str | None) -> Policy:
        """``model``'s own instance of the policy (None: the one-model path's)."""
        if model is None:
            return self.policy
        if model not in self._by_model:
            self._by_model[model] = make_policy(self.policy.name)
        return self._by_model[model]

    def pick(
        self,
        workers: Iterable[Worker],
        exclude: Sequence[int] | set[int] = frozenset(),
        prompt: list[int] | None = None,
        model: str | None = None,
    ) -> Worker:
        """A ready worker with room among ``workers``, not in ``exclude`` and of ``model`` (None:
        any), chosen by the policy; ``prompt`` (token ids) lets a cache-aware policy prefer a worker
        whose prefix cache likely holds it. Raises ``NoWorker`` (503) or ``Overloaded`` (429)."""
        ready = [
            w
            for w in workers
            if w.state == WorkerState.READY and w.worker_id not in exclude and (model is None or w.model == model)
        ]
        if not ready:
            raise NoWorker() if model is None else NoWorker(f"no worker of model '{model}' is ready")
        room = [w for w in ready if w.in_flight < w.capacity]
        if not room:
            raise Overloaded()
        chosen = self.for_model(model).pick(room, Routed(prompt=prompt))
        assert chosen is not None  # a policy returns one of a non-empty list
        return chosen

    def _owner_policy(self, worker: Worker) -> Policy:
        """The instance that picks among ``worker``'s model's replicas."""
        return self._by_model.get(worker.model, self.policy)

    def dispatched(self, req: RouterRequest, prompt: list[int] | None) -> None:
        """``req`` (with ``prompt``'s token ids, None: none) is being sent to its worker."""
        self._owner_policy(req.worker).on_dispatch(req.worker, Routed(req.request_id, prompt))

    def finished(self, req: RouterRequest) -> None:
        """``req`` ended on its worker, on any path."""
        self._owner_policy(req.worker).on_finish(req.worker.worker_id, req.request_id)

    def worker_gone(self, worker_id: int) -> None:
        """A worker's process ended or was replaced: every instance forgets what it knew of it."""
        for policy in (self.policy, *self._by_model.values()):
            policy.on_worker_gone(worker_id)
