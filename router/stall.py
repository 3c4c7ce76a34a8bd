"""When a busy worker counts as hung (``workers.stall_timeout_s``): the pure rule the router's
watchdog applies to what a worker's heartbeats said.

A hung engine loop (a deadlock, a wait that never returns) makes no step and uses no CPU, while
its I/O thread still heartbeats. A healthy engine on an overloaded host also makes no step for a
long while (one prefill chunk can take tens of seconds when the cores are shared), but it keeps
computing. So a worker is stalled only when three things agree over more than the timeout: the
router saw no new step, the worker's own clock (``EngineLoad.last_step_age_s``) saw none, and
its process used almost no CPU (``EngineLoad.cpu_s``). A GPU sync that spins on a hung kernel
burns CPU without progress, so past :data:`HARD_LIMIT_FACTOR` timeouts without a step the worker
is stalled whatever its CPU says.
"""

from __future__ import annotations

import math

HARD_LIMIT_FACTOR = 4.0  # no step for this many stall timeouts: stalled even while it uses CPU
MIN_CPU_SHARE = 0.05  # CPU seconds per second of no step below which the engine is waiting, not computing


def no_step_for(since_progress_s: float, step_age_s: float | None, since_heartbeat_s: float) -> float:
    """Seconds without an engine step by both clocks (the smaller): ``since_progress_s`` on the
    router's (since a heartbeat showed a new step count, or since the work arrived), and the
    worker's own ``step_age_s`` at its last heartbeat, aged by the ``since_heartbeat_s`` that
    have passed since that heartbeat arrived (``None``: the worker does not report it)."""
    own = math.inf if step_age_s is None else step_age_s + since_heartbeat_s
    return max(0.0, min(since_progress_s, own))


def is_stalled(quiet_s: float, cpu_used_s: float | None, timeout_s: float) -> bool:
    """True when a worker with work and no step for ``quiet_s`` seconds (:func:`no_step_for`) is
    hung: past ``timeout_s`` with under :data:`MIN_CPU_SHARE` of a core used over that time
    (``cpu_used_s``: its process's CPU seconds since the router last saw it make progress; ``None``:
    not reported, the step clocks alone decide), or past :data:`HARD_LIMIT_FACTOR` × ``timeout_s``."""
    if quiet_s <= timeout_s:
        return False
    if quiet_s > HARD_LIMIT_FACTOR * timeout_s or cpu_used_s is None:
        return True
    return cpu_used_s < MIN_CPU_SHARE * quiet_s
