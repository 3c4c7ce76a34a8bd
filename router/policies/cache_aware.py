"""``cache_aware``: send a prompt where its prefix is likely cached, unless that worker is busier.

Every worker keeps a prefix cache of full KV blocks; the policy keeps its own guess of what each
holds (:class:`~router.policies.prefix_affinity.PrefixAffinity`, filled by :meth:`on_dispatch`,
emptied when a worker's process is gone). Among the workers with at most ``slack`` more requests
in flight than the least loaded, the one likely holding most of the prompt gets it when it holds at
least ``AFFINITY_MIN_SHARE`` of the prompt's full blocks and ``AFFINITY_MIN_BLOCKS`` of them (a
repeated document, the next turn of a long chat: prefilled from that cache instead of from scratch
elsewhere); otherwise the least loaded, ties broken by rotation so that idle workers share short
requests evenly. SGLang's router does the same with a radix tree of text per worker and load
thresholds; block hashes over token ids match what the worker's cache keys on.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.policies.base import NO_PROMPT, C, Candidate, Rotation, Routed
from router.policies.prefix_affinity import PrefixAffinity

AFFINITY_MIN_SHARE = 0.5  # of the prompt's full blocks: more than a shared chat template or system prompt
AFFINITY_MIN_BLOCKS = 8  # 128 tokens at the workers' 16-token blocks: below that a prefill costs little
CACHE_AWARE_SLACK = 2  # extra requests in flight a cached prefix outweighs: sharing a batch costs less than a prefill


class CacheAware(Rotation):
    """Least loaded within ``slack`` requests, the likely cached prefix first (module docstring).
    Owns its prefix-affinity table: the only writer of it."""

    name = "cache_aware"
    summary = (
        "the worker whose prefix cache likely holds the prompt's start, even with up to "
        f"{CACHE_AWARE_SLACK} more in flight than the least loaded"
    )
    slack = CACHE_AWARE_SLACK

    def __init__(self) -> None:
        super().__init__()
        self.affinity = PrefixAffinity()

    def pick(self, candidates: Sequence[C], request: Routed = NO_PROMPT) -> C | None:
        """The chosen candidate (module docstring); None when there is none."""
        ordered = self.order(candidates)
        if not ordered:
            return None
        least = min(c.in_flight for c in ordered)
        near = [c for c in ordered if c.in_flight <= least + self.slack]
        if request.prompt is not None and len(near) > 1:
            held = {c.worker_id: self.affinity.cached(c.worker_id, request.prompt) for c in near}
            # the longest held prefix; among equal ones the less loaded, then the first in rotation
            best = max(near, key=lambda c: (held[c.worker_id][1], -c.in_flight))
            share, blocks = held[best.worker_id]
            if share >= AFFINITY_MIN_SHARE and blocks >= AFFINITY_MIN_BLOCKS:
                return self.took(best)
        return self.took(next(c for c in ordered if c.in_flight == least))

    def on_dispatch(self, worker: Candidate, request: Routed) -> None:
        """Record ``request``'s prompt as (about to be) in ``worker``'s prefix cache, sized as the
        worker reported it (``block_size`` 0: it keeps none, nothing is recorded)."""
        if request.prompt is None:
            return
        block = worker.block_size
        self.affinity.configure(worker.worker_id, block, worker.kv_budget_tokens // block if block > 0 else 0)
        self.affinity.record(worker.worker_id, list(request.prompt))

    def on_finish(self, worker_id: int, request_id: str) -> None:
        return None  # a finished prompt's blocks stay cached until the worker needs the room

    def on_worker_gone(self, worker_id: int) -> None:
        """A new process, or none: its prefix cache starts empty."""
        self.affinity.forget(worker_id)


POLICY = CacheAware
