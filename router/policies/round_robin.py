"""``round_robin``: strict rotation over the ready workers, in worker-id order."""

from __future__ import annotations

from collections.abc import Sequence

from router.policies.base import NO_PROMPT, C, Rotation, Routed, Stateless


class RoundRobin(Rotation, Stateless):
    """The next worker in id order after the previous pick; neither load nor a prompt's cached
    prefix is consulted: strict rotation is what this policy promises."""

    name = "round_robin"
    summary = "strict rotation over ready workers"

    def pick(self, candidates: Sequence[C], request: Routed = NO_PROMPT) -> C | None:
        ordered = self.order(candidates)
        return self.took(ordered[0]) if ordered else None


POLICY = RoundRobin
