"""The plan of a deployment of several models: each model's :class:`~launcher.plan.plan.ModelPlan` on
the replicas :func:`~launcher.plan.packing.place_models` gave it, and the checks across models
(the RAM all CPU replicas need together). One line per problem, each naming its model."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from launcher.config import DeployConfig
from launcher.plan.embed import EmbedFit
from launcher.plan.packing import place_models
from launcher.plan.placement import Inventory, PlacementError, WorkerSpec
from launcher.plan.plan import ModelPlan, make_plan, ram_error
from worker.contract.shapes import ModelShape
from worker.contract.units import GiB

log = logging.getLogger(__name__)

RAM_ERROR = "CPU workers need"  # how plan.ram_error's line begins: each model's is replaced by the check over all


@dataclass
class MultiModelPlan:
    """The plan of a deployment of several models: every model's :class:`ModelPlan` (``plans[k]``
    for ``names[k]``) and the problems of the whole deployment (``errors``: each model's, prefixed
    with its name, and those across models; ``errors`` stop ``up``)."""

    names: list[str]
    plans: list[ModelPlan]
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    def split(self) -> list[str]:
        """One line per worker: its model, devices and share of its GPUs (what ``plan`` shows)."""
        lines = []
        for name, plan in zip(self.names, self.plans, strict=True):
            for f in plan.fits:
                share = f" ({f.spec.share:.0%} of each GPU)" if f.spec.device == "cuda" else ""
                holds = (
                    f"needs {f.need / GiB:.2f} GiB, embeddings (no KV cache)"
                    if isinstance(f, EmbedFit)
                    else f"{f.seqs} full-length sequence(s)"
                )
                lines.append(
                    f"worker {f.spec.worker_id}: model '{name}' on {f.spec.label}{share}, "
                    f"may use {f.budget / GiB:.2f} GiB, {holds}"
                )
        return lines


def plan_models(
    cfg: DeployConfig,
    inv: Inventory,
    shapes: list[ModelShape],
    dtype: str | None = None,
    specs: list[WorkerSpec] | None = None,
) -> MultiModelPlan:
    """Place (unless ``specs`` are given) every model of ``cfg`` on ``inv`` and plan each one with
    its shape (``shapes[k]`` for ``cfg.served()[k]``). A placement error is one error line."""
    served = cfg.served()
    names = [one.name for one in served]
    errors: list[str] = []
    if specs is None:
        try:
            specs = place_models([one.workers for one in served], inv, names)
        except PlacementError as exc:
            errors.append(f"workers: {exc}")
            specs = []
    plans = [
        make_plan(cfg.for_model(k), inv, shape, dtype, specs=[s for s in specs if s.model == k])
        for k, shape in enumerate(shapes)
    ]
    result = MultiModelPlan(names, plans, errors)
    for name, plan in zip(names, plans, strict=True):
        result.errors.extend(f"model '{name}': {e}" for e in plan.errors if not e.startswith(RAM_ERROR))
        result.warnings.extend(f"model '{name}': {w}" for w in plan.warnings)
    each = ", ".join(
        f"'{name}' {sum(f.budget for f in plan.fits if f.spec.device == 'cpu') / GiB:.2f} GiB"
        for name, plan in zip(names, plans, strict=True)
    )
    if (error := ram_error([f for plan in plans for f in plan.fits], inv.ram_available_bytes, each)) is not None:
        result.errors.append(error)
    return result


def preflight_models(cfg: DeployConfig, inv: Inventory, specs: list[WorkerSpec]) -> str | None:
    """``up``'s check before loading several models: ``None`` when they fit together (or a
    model's config cannot be read here: resolving it reports that), else the errors."""
    from launcher.plan.shape import read_shapes

    shapes = read_shapes([one.model for one in cfg.served()])
    if shapes is None:
        return None
    result = plan_models(cfg, inv, shapes, specs=specs)
    for warning in result.warnings:
        log.warning("plan: %s", warning)
    for line in result.split():
        log.info("plan: %s", line)
    if result.ok:
        return None
    return "the deployment does not fit (`llamadeploy plan` shows the arithmetic):\n  " + "\n  ".join(result.errors)
