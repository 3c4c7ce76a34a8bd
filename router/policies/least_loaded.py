"""``least_loaded``: the fewest requests in flight (counted by the router the moment it dispatches,
not at the next heartbeat); a likely cached prefix breaks a tie.

It is :class:`~router.policies.cache_aware.CacheAware` with no slack: load always decides, and
among the least loaded the worker whose prefix cache likely holds most of the prompt gets it
(above the same thresholds), else the next in rotation.
"""

from __future__ import annotations

from router.policies.cache_aware import CacheAware


class LeastLoaded(CacheAware):
    """Fewest in flight; among those, the cached prefix, else rotation (module docstring)."""

    name = "least_loaded"
    summary = (
        "fewest in flight, among those the worker whose prefix cache likely holds the prompt's start, else rotation"
    )
    slack = 0


POLICY = LeastLoaded
