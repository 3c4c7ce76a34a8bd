"""Several models in one deployment: every model's replicas packed onto this machine's GPUs or cores.

Pure logic over an :class:`~launcher.plan.placement.Inventory`, built on :func:`place` (one
model's rule). Each model is placed under its own ``workers`` section, in deploy.yaml's order:

* CPU: the cores are split among all replicas of all CPU models as :func:`place` splits them
  among one model's replicas (an equal, disjoint set each, in model order).
* GPU: each model's replicas take GPU groups as :func:`place` gives them; with ``devices: auto``
  a later model starts on the GPUs the earlier ones use least. Replicas that end up on the same
  GPU (of one model or several) each get an equal share of it (``WorkerSpec.share``: its part of
  ``gpu_memory_utilization``), so a small model can sit beside another model's replica.

Worker ids are global: model 0's replicas first, then model 1's, and so on.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from launcher.plan.placement import Inventory, PlacementError, WorkerSpec, place, visible_gpus
from worker.contract.settings import WorkersConfig


def place_models(workers: list[WorkersConfig], inv: Inventory, names: list[str] | None = None) -> list[WorkerSpec]:
    """One :class:`WorkerSpec` per replica of every model (``workers[k]`` is model ``k``'s section;
    ``names[k]`` how errors name it), ``spec.model`` saying whose. One model is exactly
    :func:`place`. Raises :class:`PlacementError`, naming the model, when one cannot be placed or
    the CPU models' replicas outnumber the cores."""
    if len(workers) == 1:
        return place(workers[0], inv)
    names = names or [f"models[{k}]" for k in range(len(workers))]
    placed: list[list[WorkerSpec]] = []
    used: Counter[str] = Counter()  # GPU uuid -> replicas placed on it so far
    for k, w in enumerate(workers):
        try:
            specs = place(_least_used_first(w, inv, used), inv)
        except PlacementError as exc:
            raise PlacementError(f"model '{names[k]}': {exc}") from None
        used.update(g.uuid for s in specs for g in s.gpu_info)
        placed.append(specs)
    placed = _split_cores(placed, inv.cpus, names)
    specs = [replace(s, model=k) for k, group in enumerate(placed) for s in group]
    return [replace(s, worker_id=i, share=_share(s, used)) for i, s in enumerate(specs)]


def _least_used_first(w: WorkersConfig, inv: Inventory, used: Counter[str]) -> WorkersConfig:
    """``w`` with ``devices: auto`` turned into the visible GPUs, least used first (ties in index
    order), when earlier models use some of them; as given otherwise (and with MIG instances,
    which :func:`place` orders itself)."""
    if w.devices != "auto" or not used:
        return w
    try:
        gpus = visible_gpus(inv)
    except PlacementError:
        return w  # place() reports it
    if not gpus or any(g.is_mig for g in gpus) or inv.gpu_problems:
        return w
    ordered = sorted(gpus, key=lambda g: used[g.uuid])  # stable: index order among equals
    return w.model_copy(update={"devices": [g.index for g in ordered]})


def _split_cores(placed: list[list[WorkerSpec]], cpus: list[int], names: list[str]) -> list[list[WorkerSpec]]:
    """Re-cut the cores of the CPU models' replicas: ``len(cpus) // total`` consecutive cores
    each, in model order (each model was placed as if it had every core)."""
    total = sum(len(group) for group in placed if group and group[0].device == "cpu")
    if not total:
        return placed
    if total > len(cpus):
        who = ", ".join(f"'{names[k]}' {len(g)}" for k, g in enumerate(placed) if g and g[0].device == "cpu")
        raise PlacementError(
            f"the CPU models' replicas ({who}: {total} in all) need at least one core each, but only "
            f"{len(cpus)} cores are available; lower their replicas"
        )
    per, at, out = len(cpus) // total, 0, []
    for group in placed:
        if group and group[0].device == "cpu":
            group = [replace(s, cpus=tuple(cpus[(at + i) * per : (at + i + 1) * per])) for i, s in enumerate(group)]
            at += len(group)
        out.append(group)
    return out


def _share(spec: WorkerSpec, used: Counter[str]) -> float:
    """The part of each of its GPUs a replica may use: one over the replicas on its busiest GPU."""
    if spec.device != "cuda" or not spec.gpu_info:
        return spec.share
    return 1 / max(used[g.uuid] for g in spec.gpu_info)
