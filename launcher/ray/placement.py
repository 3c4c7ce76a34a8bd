"""Placement over a Ray cluster: which node each worker slot runs on, and what Ray reserves for it.

Pure logic over :class:`~launcher.ray.cluster.NodeInventory` (testable without Ray), the cluster
counterpart of :func:`launcher.plan.placement.place`:

* GPUs (``devices: auto`` and some node offers GPUs): each node's GPUs form groups of
  ``gpus_per_replica`` (a replica never spans nodes), each group holds ``workers_per_gpu`` slots
  (a fractional GPU each). ``replicas: auto`` takes every slot; a number takes the slots
  round-robin over the nodes, so ``replicas: 2`` on two nodes puts one on each.
* CPU (``devices: cpu``, or no GPU anywhere): a slot is ``cluster.cpus_per_worker`` cores; a node
  holds as many as its CPUs allow; ``replicas: auto`` is one per node.

Each slot reserves ``{"GPU": g, "CPU": cpus_per_worker}`` in a bundle of its node's placement
group. Which physical GPUs a slot gets is Ray's choice at start; the numbering here is for sizing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from launcher.config import ClusterConfig
from launcher.plan.placement import PlacementError, WorkerSpec
from launcher.ray.cluster import NodeInventory
from worker.contract.settings import WorkersConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RaySpec(WorkerSpec):
    """A worker slot on a Ray node: ``node_id``/``node_ip`` where it is placed first, and the bundle
    Ray reserves for it (``bundle_gpus`` GPUs, fractional when several share one; ``bundle_cpus``)."""

    node_id: str = ""
    node_ip: str = ""
    bundle_gpus: float = 0.0
    bundle_cpus: int = 1

    @property
    def bundle(self) -> dict[str, float]:
        out: dict[str, float] = {"CPU": float(self.bundle_cpus)}
        if self.bundle_gpus:
            out["GPU"] = self.bundle_gpus
        return out

    @property
    def label(self) -> str:
        what = f"gpu×{self.bundle_gpus:g}" if self.bundle_gpus else f"cpu×{self.bundle_cpus}"
        return f"ray {self.node_ip} ({self.node_id[:8]}) {what}"

    @property
    def env(self) -> dict[str, str]:
        """Nothing: Ray sets ``CUDA_VISIBLE_DEVICES`` in the actor; the actor adds the rest."""
        return {}


def describe_nodes(nodes: list[NodeInventory]) -> str:
    return ", ".join(f"{n.short}: {n.gpus} GPU(s), {n.cpus} CPU(s)" for n in nodes) or "no nodes"


def _interleave(per_node: list[list[RaySpec]]) -> list[RaySpec]:
    out: list[RaySpec] = []
    for i in range(max((len(s) for s in per_node), default=0)):
        out.extend(s[i] for s in per_node if i < len(s))
    return out


def _gpu_slots(w: WorkersConfig, cluster: ClusterConfig, node: NodeInventory) -> list[RaySpec]:
    per, k = w.gpus_per_replica, w.workers_per_gpu
    groups = node.gpus // per
    slots = groups * k
    if cluster.cpus_per_worker:
        slots = min(slots, node.cpus // cluster.cpus_per_worker)
    out = []
    for s in range(slots):
        g = s % groups
        info = node.gpu_info[g * per : (g + 1) * per]
        out.append(
            RaySpec(
                -1,
                "cuda",
                gpus=tuple(x.index for x in info),
                gpu_info=info,
                share=1 / k,
                node_id=node.node_id,
                node_ip=node.ip,
                bundle_gpus=float(per) if k == 1 else 1 / k,
                bundle_cpus=cluster.cpus_per_worker,
            )
        )
    return out


def _cpu_slots(cluster: ClusterConfig, node: NodeInventory) -> list[RaySpec]:
    per = cluster.cpus_per_worker
    return [RaySpec(-1, "cpu", node_id=node.node_id, node_ip=node.ip, bundle_cpus=per) for _ in range(node.cpus // per)]


def place_on_cluster(w: WorkersConfig, cluster: ClusterConfig, nodes: list[NodeInventory]) -> list[RaySpec]:
    """One :class:`RaySpec` per replica, numbered 0..n-1. Raises :class:`PlacementError` naming the
    key to change."""
    on_gpu = w.devices != "cpu" and any(n.gpus for n in nodes)
    if on_gpu and w.workers_per_gpu > 1 and w.gpus_per_replica > 1:
        raise PlacementError(
            "workers_per_gpu > 1 with gpus_per_replica > 1 cannot be reserved on Ray (a fractional share of "
            "several GPUs); set one of them to 1"
        )
    if on_gpu:
        per_node = [_gpu_slots(w, cluster, n) for n in nodes]
        if short := [n.short for n in nodes if 0 < n.gpus < w.gpus_per_replica]:
            log.warning("Ray node(s) %s have fewer GPUs than gpus_per_replica=%d: unused", short, w.gpus_per_replica)
        unit = f"groups of gpus_per_replica={w.gpus_per_replica} × workers_per_gpu={w.workers_per_gpu}"
    else:
        per_node = [_cpu_slots(cluster, n) for n in nodes]
        unit = f"cluster.cpus_per_worker={cluster.cpus_per_worker} core(s) each"
    slots = _interleave(per_node)
    if not slots:
        if on_gpu:
            raise PlacementError(
                f"workers.gpus_per_replica={w.gpus_per_replica} but no Ray node has that many GPUs and "
                f"{cluster.cpus_per_worker} CPU(s) per worker free ({describe_nodes(nodes)}); a replica "
                "cannot span nodes: lower gpus_per_replica or cluster.cpus_per_worker"
            )
        raise PlacementError(
            f"no Ray node has cluster.cpus_per_worker={cluster.cpus_per_worker} CPU(s) for a CPU replica "
            f"({describe_nodes(nodes)}); lower cluster.cpus_per_worker"
        )
    if w.replicas == "auto":
        replicas = len(slots) if on_gpu else sum(1 for s in per_node if s)
    else:
        replicas = w.replicas
    if replicas > len(slots):
        raise PlacementError(
            f"workers.replicas={replicas} but the Ray cluster gives only {len(slots)} replica slot(s) ({unit}; "
            f"{describe_nodes(nodes)}); lower replicas or add nodes"
        )
    if not on_gpu and w.replicas == "auto":
        chosen = [s[0] for s in per_node if s]
    else:
        chosen = slots[:replicas]
    return [replace(s, worker_id=i) for i, s in enumerate(chosen)]


def missing_room(specs: list[RaySpec], free: dict[str, dict[str, float]]) -> str:
    """What the placed slots need on each node beyond Ray's free resources there (``free``: node id
    -> resource -> amount, as ``ray._private.state.available_resources_per_node`` gives it), as one
    clause per short node; "" when every node has room."""
    need: dict[str, dict[str, float]] = {}
    for s in specs:
        for k, v in s.bundle.items():
            need.setdefault(s.node_id, {})[k] = need.get(s.node_id, {}).get(k, 0.0) + v
    short = []
    for node_id, wanted in need.items():
        have = free.get(node_id, {})
        if any(have.get(k, 0.0) + 1e-3 < v for k, v in wanted.items()):  # Ray counts in 1e-4 units
            ip = next(s.node_ip for s in specs if s.node_id == node_id)
            parts = ", ".join(f"{k} {v:g}" for k, v in sorted(wanted.items()))
            frees = ", ".join(f"{k} {have.get(k, 0.0):g}" for k in sorted(wanted))
            short.append(f"{ip} ({node_id[:8]}) needs {parts}, has {frees} free")
    return "; ".join(short)
