"""The Ray cluster as the launcher sees it: connecting, each node's inventory, and the refusals.

``cluster.backend: ray`` runs every worker slot as a Ray actor (:mod:`launcher.ray_backend`). Before
anything starts, ``llamadeploy up`` and ``plan`` :func:`connect` to ``cluster.address`` (a TCP
check first: Ray's own connect retries for minutes on an address where nothing listens) and read
:func:`nodes`: per alive node its CPUs, GPUs (Ray's ``GPU`` resource) and the memory of those GPUs,
read through NVML by a tiny task pinned to the node (:func:`gpu_probe`), or ``cluster.gpu_memory_gib``
where NVML cannot be read there. :func:`launcher.ray_placement.place_on_cluster` then lays the
slots out over the nodes. Every problem is a :class:`ClusterError`: one line naming the key and the fix.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from launcher.config import ClusterConfig
from launcher.placement import GpuInfo, Inventory

log = logging.getLogger(__name__)

GiB = 2**30
NAMESPACE = "llamadeploy"  # the Ray namespace of a deployment's actors and placement groups
CONNECT_CHECK_S = 3.0  # the TCP check before ray.init
PROBE_TIMEOUT_S = 30.0
RAY_MISSING = (
    "cluster.backend is ray but Ray is not installed here: pip install 'llamadeploy[ray]' "
    "(the same version on every node), or set cluster.backend: local"
)


class ClusterError(Exception):
    """The Ray cluster cannot be used; ``str()`` is one line naming ``cluster.*`` and the fix."""


@dataclass(frozen=True)
class NodeInventory:
    """One alive Ray node: its id (hex), address, whole CPUs and GPUs Ray offers, and those GPUs
    (``gpu_info``, numbered 0..n-1 as Ray numbers them; memory in bytes, 0 when unknown)."""

    node_id: str
    ip: str
    cpus: int
    gpus: int
    gpu_info: tuple[GpuInfo, ...] = field(default=(), compare=False)
    head: bool = False

    @property
    def short(self) -> str:
        return f"{self.ip} ({self.node_id[:8]})"

    @property
    def memory_known(self) -> bool:
        return all(g.total_bytes > 0 for g in self.gpu_info)


def _host_port(address: str) -> tuple[str, int]:
    parts = urlsplit(address if "://" in address else f"tcp://{address}")
    if not parts.hostname or not parts.port:
        raise ClusterError(
            f"cluster.address {address!r} is not HOST:PORT or ray://HOST:PORT; use e.g. head-node:6379 or auto"
        )
    return parts.hostname, parts.port


def resolve_address(address: str) -> str:
    """``cluster.address`` as ``ray.init`` takes it: ``auto`` is ``RAY_ADDRESS``, else the head a
    ``ray start`` on this machine left (Ray's own lookup). Raises :class:`ClusterError`."""
    if address != "auto":
        return address
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    from ray._private import services

    try:
        found = services.get_ray_address_from_environment("auto", None)
    except (ConnectionError, ValueError) as exc:
        raise ClusterError(
            f"cluster.address is auto but no Ray cluster runs on this machine and RAY_ADDRESS is unset ({exc}); "
            "start one (`ray start --head --port=6379`) or set cluster.address: HEAD:6379"
        ) from None
    if not found or found == "auto":
        raise ClusterError(
            "cluster.address is auto but no Ray cluster runs on this machine and RAY_ADDRESS is unset; "
            "start one (`ray start --head --port=6379`) or set cluster.address: HEAD:6379"
        )
    return found


def connect(cluster: ClusterConfig) -> str:
    """Connect this process to the Ray cluster of ``cluster.address`` (namespace
    :data:`NAMESPACE`); returns the address used. Raises :class:`ClusterError` when Ray is missing
    or no cluster answers there (within :data:`CONNECT_CHECK_S`), before anything is started."""
    # Every worker's log lines reach the launcher's output as they are (Ray would fold similar
    # lines from different workers into one "[repeated Nx across cluster]"); read at Ray's import.
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    try:
        import ray
    except ImportError:
        raise ClusterError(RAY_MISSING) from None
    address = resolve_address(cluster.address)
    host, port = _host_port(address)
    shown = address if address == cluster.address else f"{cluster.address} = {address}"
    try:
        socket.create_connection((host, port), timeout=CONNECT_CHECK_S).close()
    except OSError as exc:
        raise ClusterError(
            f"cluster.address {shown}: no Ray cluster answers at {host}:{port} ({exc}); start it "
            "(`ray start --head --port=6379` on the head node) or fix cluster.address"
        ) from None
    try:
        ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING, log_to_driver=True)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ClusterError(f"cluster.address {shown}: cannot join the Ray cluster: {exc}") from None
    return address


def local_ip() -> str:
    """This process's address on the cluster, as Ray sees it (where remote workers reach the router)."""
    import ray

    return ray.util.get_node_ip_address()


def gpu_probe() -> list[dict]:
    """On a node: every GPU NVML lists there (index, name, uuid, total and free bytes, capability)."""
    from launcher.placement import nvml_gpus

    return [
        {
            "index": g.index,
            "name": g.name,
            "uuid": g.uuid,
            "total_bytes": g.total_bytes,
            "free_bytes": g.free_bytes,
            "capability": g.capability,
        }
        for g in nvml_gpus()
        if not g.is_mig
    ]


def _probe_nodes(node_ids: list[str]) -> dict[str, list[dict]]:
    """Run :func:`gpu_probe` on each node (no resources held); ``[]`` where it fails or times out."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0)(gpu_probe)
    refs = {
        n: task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote() for n in node_ids
    }
    out: dict[str, list[dict]] = {}
    for node, ref in refs.items():
        try:
            out[node] = ray.get(ref, timeout=PROBE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 (any failure there means: memory unknown on that node)
            log.warning("cannot read the GPUs of node %s through NVML: %s", node[:8], exc)
            ray.cancel(ref, force=True)
            out[node] = []
    return out


def node_gpus(count: int, nvml: list[dict], declared_gib: float | None) -> tuple[GpuInfo, ...]:
    """The ``count`` GPUs Ray offers on a node, for sizing: NVML's figures (the smallest of the GPUs
    it lists, since Ray does not say which physical GPUs it offers), else ``declared_gib``, else
    memory 0 (unknown)."""
    if nvml:
        small = min(nvml, key=lambda g: g["free_bytes"])
        cap = tuple(small["capability"]) if small.get("capability") else None
        return tuple(
            GpuInfo(i, small["name"], "", small["total_bytes"], small["free_bytes"], cap) for i in range(count)
        )
    total = int(declared_gib * GiB) if declared_gib else 0
    name = "(cluster.gpu_memory_gib)" if declared_gib else "(memory unknown)"
    return tuple(GpuInfo(i, name, "", total, total) for i in range(count))


def nodes(cluster: ClusterConfig) -> list[NodeInventory]:
    """The alive nodes of the connected cluster, the head first. Raises :class:`ClusterError` when
    there is none."""
    import ray

    alive = [n for n in ray.nodes() if n.get("Alive")]
    if not alive:
        raise ClusterError(f"cluster.address {cluster.address}: the Ray cluster has no alive node; start one")
    with_gpus = [n["NodeID"] for n in alive if int(n["Resources"].get("GPU", 0)) > 0]
    probed = _probe_nodes(with_gpus) if with_gpus else {}
    out = []
    for n in alive:
        res = n["Resources"]
        gpus = int(res.get("GPU", 0))
        head = "node:__internal_head__" in res
        info = node_gpus(gpus, probed.get(n["NodeID"], []), cluster.gpu_memory_gib)
        out.append(NodeInventory(n["NodeID"], n["NodeManagerAddress"], int(res.get("CPU", 0)), gpus, info, head))
    out.sort(key=lambda x: (not x.head, x.ip, x.node_id))
    for node in out:
        log.info(
            "Ray node %s: %d CPU(s), %d GPU(s)%s",
            node.short,
            node.cpus,
            node.gpus,
            f" of {node.gpu_info[0].total_bytes / GiB:.1f} GiB" if node.gpus and node.memory_known else "",
        )
    return out


def cluster_inventory(all_nodes: list[NodeInventory]) -> Inventory:
    """An :class:`~launcher.placement.Inventory` of the whole cluster for :mod:`launcher.plan`: every
    node's GPUs, no RAM figure (it is per node; a CPU replica's room is ``kv_cache_gib``)."""
    from worker.dtypes import cpu_flags

    gpus = [g for n in all_nodes for g in n.gpu_info]
    return Inventory(gpus, list(range(sum(n.cpus for n in all_nodes))), None, 0, cpu_flags=cpu_flags())
