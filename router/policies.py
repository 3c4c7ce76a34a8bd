"""Load-balancing policies: which ready worker gets the next request. Pure logic, no I/O.

* ``round_robin``: strict rotation over the ready workers, in worker-id order.
* ``least_loaded``: the fewest in-flight requests (counted by the router the moment it dispatches,
  not at the next heartbeat). Among the least loaded, a worker whose prefix cache likely holds most
  of the prompt (:mod:`router.prefix_affinity`: at least ``AFFINITY_MIN_SHARE`` of its full blocks
  and ``AFFINITY_MIN_BLOCKS`` of them) gets it: a repeated document or the next turn of a long
  chat is prefilled from that cache instead of from scratch elsewhere. Otherwise ties are broken
  by the same rotation, so idle workers share short requests evenly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, Protocol

AFFINITY_MIN_SHARE = 0.5  # of the prompt's full blocks: more than a shared chat template or system prompt
AFFINITY_MIN_BLOCKS = 8  # 128 tokens at the workers' 16-token blocks: below that a prefill costs little


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

    def pick(self, candidates: Sequence[Candidate], cached: Callable[[Candidate], tuple[float, int]] | None = None):
        """The next worker in id order after the previous pick (``cached`` is not consulted: strict
        rotation is what this policy promises); ``None`` when there is none."""
        ordered = self.order(candidates)
        return self.took(ordered[0]) if ordered else None


class LeastLoaded(Rotation):
    name = "least_loaded"

    def pick(
        self, candidates: Sequence[Candidate], cached: Callable[[Candidate], tuple[float, int]] | None = None
    ) -> Candidate | None:
        """The worker with the fewest in-flight requests; among those, the one ``cached`` says holds
        the most of the prompt (``(share of its full blocks, blocks)``) when that clears both
        affinity thresholds, else the next in rotation. ``None`` when there is no candidate."""
        ordered = self.order(candidates)
        if not ordered:
            return None
        least = min(c.in_flight for c in ordered)
        tied = [c for c in ordered if c.in_flight == least]
        if cached is not None and len(tied) > 1:
            held = {c.worker_id: cached(c) for c in tied}
            best = max(tied, key=lambda c: held[c.worker_id][1])  # first of the longest, in rotation order
            share, blocks = held[best.worker_id]
            if share >= AFFINITY_MIN_SHARE and blocks >= AFFINITY_MIN_BLOCKS:
                return self.took(best)
        return self.took(tied[0])


# The registry: the one list of policy names. router.policy (config), the CLI's --policy help, the
# admin API and the affinity bench read it; a new policy is a class in its own module plus a line here.
POLICIES = {"least_loaded": LeastLoaded, "round_robin": RoundRobin}
PolicyName = Literal[tuple(POLICIES)]  # the config's type: exactly the registered names


def make_policy(name: str) -> RoundRobin | LeastLoaded:
    """Build a policy by its config name. Raises ``KeyError`` for an unknown name."""
    return POLICIES[name]()
