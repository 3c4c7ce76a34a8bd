"""The Ray cluster as the launcher sees it: connecting, each node's inventory, and the refusals.

``cluster.backend: ray`` runs every worker slot as a Ray actor (:mod:`launcher.ray.backend`). Before
anything starts, ``llamadeploy up`` and ``plan`` :func:`connect` to ``cluster.address`` (a TCP
check first: Ray's own connect retries for minutes on an address where nothing listens) and read
:func:`nodes`: per alive node its CPUs, GPUs (Ray's ``GPU`` resource) and the memory of those GPUs,
read through NVML by a tiny task pinned to the node (:func:`gpu_probe`), or ``cluster.gpu_memory_gib``
where NVML cannot be read there. :func:`launcher.ray.placement.place_on_cluster` then lays the
slots out over the nodes. Every problem is a :class:`ClusterError`: one line naming the key and the fix.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from launcher.config import ClusterConfig
from launcher.plan.placement import GpuInfo, Inventory
from worker.contract.units import GiB

log = logging.getLogger(__name__)

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
    """``cluster.address`` (``HOST:PORT`` or ``ray://HOST:PORT``) as (host, port). Raises
    :class:`ClusterError` for any other form (another scheme, no port, a port that is not 1-65535)."""
    scheme = address.split("://", 1)[0] if "://" in address else ""
    if scheme not in ("", "ray"):
        raise ClusterError(
            f"cluster.address {address!r}: {scheme}:// is not a Ray address; use HOST:6379 (the head's GCS "
            "port, `ray start --head --port`) or ray://HOST:10001 (Ray Client)"
        )
    try:
        parts = urlsplit(address if scheme else f"tcp://{address}")
        host, port = parts.hostname, parts.port
    except ValueError:  # a port that is not a number, or out of range
        host = port = None
    if not host or not port:
        raise ClusterError(
            f"cluster.address {address!r} is not HOST:PORT or ray://HOST:PORT; use e.g. head-node:6379 or auto"
        )
    return host, port


# A gRPC server (Ray's GCS, the Ray Client server) answers an HTTP/2 client preface with a SETTINGS
# frame (RFC 9113 3.4); anything else (a dashboard, another service) does not, and ray.init would
# retry there for minutes.
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
HTTP2_SETTINGS = 4


def _answers_grpc(sock: socket.socket, timeout: float) -> bool:
    """Whether the peer on ``sock`` speaks HTTP/2 (gRPC): its first frame is SETTINGS."""
    sock.settimeout(timeout)
    try:
        sock.sendall(HTTP2_PREFACE)
        head = b""
        while len(head) < 9:
            chunk = sock.recv(9 - len(head))
            if not chunk:
                break
            head += chunk
    except OSError:
        return False
    return len(head) == 9 and head[3] == HTTP2_SETTINGS


def _uses_tls() -> bool:
    return os.environ.get("RAY_USE_TLS", "").lower() in ("1", "true")


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
    or no cluster answers there (no TCP connection, or no gRPC answer on it, within
    :data:`CONNECT_CHECK_S`), before anything is started."""
    # Every worker's log lines reach the launcher's output as they are (Ray would fold similar
    # lines from different workers into one "[repeated Nx across cluster]"); read at Ray's import.
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if not sys.stderr.isatty():  # no colour codes in a log file (Ray colours each line's prefix)
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    try:
        import ray
    except ImportError:
        raise ClusterError(RAY_MISSING) from None
    address = resolve_address(cluster.address)
    try:
        host, port = _host_port(address)
    except ClusterError as exc:
        if address == cluster.address:
            raise
        raise ClusterError(f"{exc} (cluster.address is auto: RAY_ADDRESS gave it)") from None
    shown = address if address == cluster.address else f"{cluster.address} = {address}"
    try:
        sock = socket.create_connection((host, port), timeout=CONNECT_CHECK_S)
    except OSError as exc:
        raise ClusterError(
            f"cluster.address {shown}: no Ray cluster answers at {host}:{port} ({exc}); start it "
            "(`ray start --head --port=6379` on the head node) or fix cluster.address"
        ) from None
    with sock:
        grpc = _uses_tls() or _answers_grpc(sock, CONNECT_CHECK_S)
    if not grpc:
        raise ClusterError(
            f"cluster.address {shown}: something listens at {host}:{port} but it is not Ray (no gRPC answer "
            f"within {CONNECT_CHECK_S:g}s); use the head's GCS port (`ray start --head --port`, 6379) or "
            "ray://HOST:10001 for Ray Client"
        )
    if address.startswith("ray://"):
        from ray._private.utils import get_ray_client_dependency_error

        if (missing := get_ray_client_dependency_error()) is not None:
            raise ClusterError(
                f"cluster.address {shown}: Ray Client (ray://) needs Ray's client extra, not installed here "
                f"({missing}); install it at this Ray's version, or use the head's GCS address HOST:6379"
            )
    try:
        ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING, log_to_driver=True)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        why = " ".join(str(exc).split())  # one line: Ray's messages span several
        raise ClusterError(f"cluster.address {shown}: cannot join the Ray cluster: {why}") from None
    return address


def local_ip() -> str:
    """This process's address on the cluster, as Ray sees it (where remote workers reach the router)."""
    import ray

    return ray.util.get_node_ip_address()


def gpu_probe() -> list[dict]:
    """On a node: every GPU NVML lists there (index, name, uuid, total and free bytes, capability)."""
    from launcher.plan.placement import nvml_gpus

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


def free_resources() -> dict[str, dict[str, float]] | None:
    """Resources not reserved on each alive node (Ray's own figure, as vLLM reads it; it lags a
    release by a second or two), or None where this Ray cannot say."""
    import ray

    try:
        from ray._private.state import available_resources_per_node

        free = available_resources_per_node()
    except (ImportError, AttributeError, RuntimeError):
        return None
    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    return {n: r for n, r in free.items() if n in alive}


def cluster_inventory(all_nodes: list[NodeInventory]) -> Inventory:
    """An :class:`~launcher.plan.placement.Inventory` of the whole cluster for :mod:`launcher.plan.plan`: every
    node's GPUs, no RAM figure (it is per node; a CPU replica's room is ``kv_cache_gib``)."""
    from worker.contract.dtypes import cpu_flags

    gpus = [g for n in all_nodes for g in n.gpu_info]
    return Inventory(gpus, list(range(sum(n.cpus for n in all_nodes))), None, 0, cpu_flags=cpu_flags())
