"""The one check a configuration passes before it runs, for ``up`` and for ``apply`` alike.

:func:`admit` says whether ``cfg`` can run on a machine's devices: each model's tensor-parallel
split, the placement of every replica (cores, GPUs) and the memory plan (weights, KV-cache
budget, one full-length sequence), with ``llamadeploy plan``'s arithmetic. ``up`` refuses on
its answer (the memory plan only warns with ``--force``); the supervisor refuses an ``apply``
on the same answer, and ``apply --dry-run`` reports it, so neither can accept a file the other
refuses.
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.config import DeployConfig
from launcher.plan.placement import Inventory, PlacementError, WorkerSpec


class NotAdmitted(Exception):
    """``cfg`` cannot run here whatever the flags: ``str()`` is the reason (one line per problem)."""


@dataclass(frozen=True)
class Admission:
    """Where ``cfg``'s replicas go (``specs``), the configuration as it will run (``config``:
    ``model.max_model_len: auto`` resolved, :mod:`launcher.plan.resolve`) and the memory plan's
    objection (None: it fits)."""

    specs: list[WorkerSpec]
    config: DeployConfig
    memory_problem: str | None = None


def admit(cfg: DeployConfig, inventory: Inventory) -> Admission:
    """Check ``cfg`` against ``inventory`` (the machine's devices). Raises :class:`NotAdmitted`
    for a tensor-parallel split a model cannot take or a placement that does not exist; returns
    the placement with the memory plan's verdict (its errors and the fix, or None)."""
    from launcher.plan.layouts import tp_refusal
    from launcher.plan.packing import place_models
    from launcher.plan.plan import preflight
    from launcher.plan.resolve import resolve_at_start
    from launcher.plan.several import preflight_models

    served = cfg.served()
    for k in range(len(served)):  # each model under its own workers section
        if problem := tp_refusal(cfg.for_model(k)):
            raise NotAdmitted(problem)
    try:
        specs = place_models([one.workers for one in served], inventory, [one.name for one in served])
    except PlacementError as exc:
        raise NotAdmitted(f"workers: {exc}") from None
    cfg = resolve_at_start(cfg, inventory, specs)
    check = preflight if len(served) == 1 else preflight_models
    return Admission(specs, cfg, check(cfg, inventory, specs))
