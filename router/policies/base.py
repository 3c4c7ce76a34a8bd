"""What a routing policy is: the :class:`Policy` protocol, the request and the workers as a policy
sees them, and the rotation cursor the policies share. Pure logic, no I/O."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, TypeVar


class Candidate(Protocol):
    """A ready worker with room, as a policy sees it (the router's :class:`router.workers.Worker`)."""

    worker_id: int
    in_flight: int  # requests the router has sent it and not yet finished
    block_size: int  # tokens per KV block of its prefix cache (0: it keeps none)
    kv_budget_tokens: int  # its KV cache's size in tokens


C = TypeVar("C", bound=Candidate)


@dataclass(frozen=True)
class Routed:
    """A request as a policy sees it: its wire id and its prompt's token ids (None: no prompt the
    worker caches, an embedding request or a caller that does not say)."""

    request_id: str = ""
    prompt: Sequence[int] | None = None


NO_PROMPT = Routed()  # what a caller that says nothing of its request passes


class Policy(Protocol):
    """A load-balancing policy (SGLang's router ``LoadBalancingPolicy`` trait): ``pick`` chooses,
    the hooks let a policy that keeps state keep it. The router calls them from its one event loop
    (no locks) with one instance per served model."""

    name: ClassVar[str]  # its config name, ``router.policy``
    summary: ClassVar[str]  # what it does, in a few words: the config reference's help for its name

    def pick(self, candidates: Sequence[C], request: Routed) -> C | None:
        """One of ``candidates`` (never empty when the router asks; None when it is)."""
        ...

    def on_dispatch(self, worker: Candidate, request: Routed) -> None:
        """``request`` was sent to ``worker`` (the worker ``pick`` chose, or one a retry chose)."""
        ...

    def on_finish(self, worker_id: int, request_id: str) -> None:
        """The request ended on the worker, on any path (done, error, cancel, loss)."""
        ...

    def on_worker_gone(self, worker_id: int) -> None:
        """The worker's process ended or was replaced: whatever the policy knew of it is stale."""
        ...


class Stateless:
    """The hooks of a policy that keeps nothing beyond its own rotation: all no-ops."""

    def on_dispatch(self, worker: Candidate, request: Routed) -> None:
        return None

    def on_finish(self, worker_id: int, request_id: str) -> None:
        return None

    def on_worker_gone(self, worker_id: int) -> None:
        return None


class Rotation:
    """A cursor over worker ids: ``order(candidates)`` starts just after the last one picked, so a
    rotation survives workers leaving and joining."""

    def __init__(self) -> None:
        self.last = -1

    def order(self, candidates: Sequence[C]) -> list[C]:
        """``candidates`` by worker id, starting after the last one :meth:`took`."""
        ranked = sorted(candidates, key=lambda c: c.worker_id)
        after = [c for c in ranked if c.worker_id > self.last]
        return after + [c for c in ranked if c.worker_id <= self.last]

    def took(self, chosen: C) -> C:
        """Move the cursor to ``chosen`` and return it."""
        self.last = chosen.worker_id
        return chosen
