"""Load-balancing policies: which ready worker gets the next request. Pure logic, no I/O.

* ``round_robin``: strict rotation over the ready workers, in worker-id order.
* ``least_loaded``: the fewest in-flight requests (counted by the router the moment it dispatches,
  not at the next heartbeat); ties are broken by the same rotation, so idle workers share evenly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Candidate(Protocol):
    worker_id: int
    in_flight: int


class Rotation:
    """A cursor over worker ids: ``order(candidates)`` starts just after the last one picked."""

    def __init__(self) -> None:
        self.last = -1

    def order(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        ranked = sorted(candidates, key=lambda c: c.worker_id)
        after = [c for c in ranked if c.worker_id > self.last]
        return after + [c for c in ranked if c.worker_id <= self.last]

    def took(self, chosen: Candidate) -> Candidate:
        self.last = chosen.worker_id
        return chosen


class RoundRobin(Rotation):
    name = "round_robin"

    def pick(self, candidates: Sequence[Candidate]) -> Candidate | None:
        """The next worker in id order after the previous pick; ``None`` when there is none."""
        ordered = self.order(candidates)
        return self.took(ordered[0]) if ordered else None


class LeastLoaded(Rotation):
    name = "least_loaded"

    def pick(self, candidates: Sequence[Candidate]) -> Candidate | None:
        """The worker with the fewest in-flight requests; ties go to the next in rotation."""
        ordered = self.order(candidates)
        return self.took(min(ordered, key=lambda c: c.in_flight)) if ordered else None


POLICIES = {"round_robin": RoundRobin, "least_loaded": LeastLoaded}


def make_policy(name: str) -> RoundRobin | LeastLoaded:
    """Build a policy by its config name. Raises ``KeyError`` for an unknown name."""
    return POLICIES[name]()
