"""Room for a rollout's new replicas: the memory free beside a slot, what one replica needs, and
where a new slot goes (the placement rules of ``up``: a new CPU slot gets its own core set, a GPU
slot the same GPUs as the replica it replaces). A CPU replacement with no spare core set loads on
the cores of the replica it replaces, which serves meanwhile (slower for those seconds, never
down), wherever the RAM holds both copies."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from dataclasses import replace

from launcher.config import DeployConfig
from launcher.plan.placement import Inventory, WorkerSpec

log = logging.getLogger(__name__)

UNKNOWN_NEED = sys.maxsize  # a replica whose size cannot be planned never surges


def spare_cpus(specs: Iterable[WorkerSpec], cpus: list[int], count: int) -> tuple[int, ...] | None:
    """``count`` of ``cpus`` that no slot in ``specs`` holds (lowest first), or None when fewer are free."""
    used = {c for s in specs for c in s.cpus}
    free = [c for c in cpus if c not in used]
    return tuple(free[:count]) if count and len(free) >= count else None


def free_beside(spec: WorkerSpec, specs: Iterable[WorkerSpec], inv: Inventory) -> int:
    """Bytes free for a second copy of slot ``spec``: on a CPU the available RAM (the copy loads on
    a spare core set, else on ``spec``'s own cores: :func:`new_spec`), on GPUs the least free
    memory of its GPUs (0 when unknown, as on a Ray cluster, where no local inventory lists them)."""
    if spec.device == "cpu":
        return inv.ram_available_bytes
    free = {g.index: g.free_bytes for g in inv.gpus}
    return min((free.get(i, 0) for i in spec.gpus), default=0)


def new_spec(
    like: WorkerSpec,
    worker_id: int,
    specs: Iterable[WorkerSpec],
    inv: Inventory,
    cluster: bool = False,
    share: bool = False,
) -> WorkerSpec | None:
    """Where new slot ``worker_id`` runs, shaped like ``like``: a spare core set of the same size
    on a CPU, else (``share``: a replacement of ``like``, which stops once it is ready) ``like``'s
    own cores, else None; the same GPUs on a GPU (the plan surges only where their free memory
    holds the copy). ``cluster``: Ray places the slot's actor on a node with room, so the shape is
    all it needs."""
    if like.device != "cpu" or cluster:
        return replace(like, worker_id=worker_id)
    cpus = spare_cpus(specs, inv.cpus, len(like.cpus)) or (like.cpus if share else None)
    return replace(like, worker_id=worker_id, cpus=cpus) if cpus else None


def replica_need(cfg: DeployConfig, inv: Inventory, spec: WorkerSpec) -> int:
    """Bytes one replica of ``cfg`` takes on ``spec``'s device (``llamadeploy plan``'s arithmetic):
    on a CPU weights + overhead + its KV budget, on GPUs weights + overhead + one full-length
    sequence's KV cache; an embedding model's weights + overhead (:mod:`launcher.plan.embed`).
    :data:`UNKNOWN_NEED` when the model's shape cannot be read here."""
    from launcher.models import ModelNotFound
    from launcher.plan.embed import EmbedFit
    from launcher.plan.plan import make_plan
    from launcher.plan.shape import read_shape
    from worker.contract.shapes import ShapeError

    try:
        plan = make_plan(cfg, inv, read_shape(cfg.model.name, cfg.model), specs=[spec])
    except (ModelNotFound, ShapeError, OSError, ValueError) as exc:
        log.info("no surge: the new replica's size is unknown (%s)", exc)
        return UNKNOWN_NEED
    fit = plan.fits[0]
    if isinstance(fit, EmbedFit):  # an embedding replica: weights + one step's activations, no KV cache
        return fit.need
    return fit.budget if spec.device == "cpu" else plan.sizing.weights + fit.overhead + plan.sizing.kv_per_seq
