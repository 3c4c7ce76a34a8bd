"""``llamadeploy up`` and ``plan`` with ``cluster.backend: ray``: every check before anything starts.

:func:`prepare_ray` connects to the cluster, reads its inventory, places the slots, runs the same
memory plan as locally (:func:`launcher.plan.plan.preflight`, over the cluster's GPUs), resolves the
model and the router's ZeroMQ address (``tcp://`` with CURVE, bound where the nodes reach it),
then makes the :class:`~launcher.ray.backend.RayBackend`. Any refusal is a
:class:`~launcher.ray.cluster.ClusterError` (``up`` exits 2 with its one line).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from launcher.config import DeployConfig
from launcher.plan.placement import Inventory, PlacementError
from launcher.ray.cluster import ClusterError, cluster_inventory, connect, free_resources, local_ip, nodes
from launcher.ray.placement import RaySpec, missing_room, place_on_cluster

__all__ = ["UNKNOWN_MEMORY", "ClusterError", "RayLaunch", "cluster_layout", "prepare_ray", "zmq_address"]

log = logging.getLogger(__name__)


@dataclass
class RayLaunch:
    specs: list[RaySpec]
    model_path: Path
    address: str  # the router's ZeroMQ endpoint, tcp://
    backend: object  # launcher.ray.backend.RayBackend
    cfg: DeployConfig  # the deployment's, max_model_len resolved (launcher.plan.context)


def cluster_layout(cfg: DeployConfig) -> tuple[Inventory, list[RaySpec], bool]:
    """Connect, read the nodes and place the slots: the cluster's Inventory (for the plan), the
    specs, and whether every GPU's memory is known. Raises ClusterError."""
    connect(cfg.cluster)
    found = nodes(cfg.cluster)
    try:
        specs = place_on_cluster(cfg.workers, cfg.cluster, found)
    except PlacementError as exc:
        raise ClusterError(f"workers: {exc}") from None
    known = all(n.memory_known for n in found if any(s.node_id == n.node_id and s.device == "cuda" for s in specs))
    return cluster_inventory(found), specs, known


ROOM_WAIT_S = 10.0  # Ray's free figures lag a release (a deployment that just stopped)


def check_room(specs: list[RaySpec], wait_s: float = ROOM_WAIT_S) -> None:
    """Refuse, before anything starts, slots the cluster's free resources cannot hold now (another
    deployment or Ray job holds them): re-read for up to ``wait_s``. Raises ClusterError."""
    deadline = time.monotonic() + wait_s
    while (free := free_resources()) is not None and (short := missing_room(specs, free)):
        if time.monotonic() >= deadline:
            raise ClusterError(
                f"workers: the Ray cluster has no room now for {len(specs)} worker(s): {short} (another "
                "deployment or Ray job holds the rest; `ray status` shows it); stop it, or lower workers.replicas"
            )
        time.sleep(0.5)


UNKNOWN_MEMORY = (
    "the GPU memory of a Ray node cannot be read through NVML there; set cluster.gpu_memory_gib "
    "(GiB per GPU) to size the deployment"
)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def unreachable(host: str, specs: list[RaySpec], key: str) -> str:
    """Why workers on the nodes of ``specs`` could not connect to the router's ZeroMQ socket at
    ``host`` (the address they are given), or "": an unspecified address (0.0.0.0, ::) names no
    machine (a remote node would connect to itself), a loopback one only this machine."""
    try:
        unspecified = ipaddress.ip_address("0.0.0.0" if host == "*" else host).is_unspecified  # "*": every interface
    except ValueError:
        unspecified = False  # a host name: the nodes resolve it
    if key == "router.zmq_address":
        fix = "give this machine's address on the cluster there, or drop router.zmq_address (cluster.router_host: auto finds it)"
    else:
        fix = "set cluster.router_host: auto (this machine's address on the cluster, as Ray sees it) or that address"
    if unspecified:
        return f"{key} {host}: the workers connect to this address, so it must name this machine; {fix}"
    remote = sorted({s.node_ip for s in specs if not _is_loopback(s.node_ip)})
    if _is_loopback(host) and remote:
        return f"{key} {host} is loopback, but workers run on {', '.join(remote)}, which cannot reach it there; {fix}"
    return ""


def zmq_address(cfg: DeployConfig, specs: list[RaySpec] = ()) -> str:
    """``router.zmq_address``, else ``tcp://ROUTER_HOST:cluster.zmq_port`` (``router_host: auto`` =
    this machine's address on the cluster). Raises ClusterError when the port is taken here, or
    when the workers of ``specs`` could not reach that address (:func:`unreachable`)."""
    if cfg.router.zmq_address:
        host = urlsplit(cfg.router.zmq_address).hostname or ""
        if problem := unreachable(host, specs, "router.zmq_address"):
            raise ClusterError(problem)
        return cfg.router.zmq_address
    host = local_ip() if cfg.cluster.router_host == "auto" else cfg.cluster.router_host
    if problem := unreachable(host, specs, "cluster.router_host"):
        raise ClusterError(problem)
    port = cfg.cluster.zmq_port
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as exc:
        raise ClusterError(
            f"cluster.zmq_port {port} on {host} (cluster.router_host): cannot bind ({exc}); choose a free port "
            "or set cluster.router_host to this machine's address on the cluster network"
        ) from None
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def prepare_ray(cfg: DeployConfig, force: bool) -> RayLaunch:
    """Everything ``up`` does before starting the router, for a Ray cluster. Raises ClusterError."""
    from launcher.models import ModelNotFound, resolve_model
    from launcher.plan.plan import preflight
    from launcher.plan.resolve import resolve_at_start
    from launcher.ray.backend import RayBackend

    inventory, specs, known = cluster_layout(cfg)
    check_room(specs)
    cfg = resolve_at_start(cfg, inventory if known else None, specs)
    if not known:
        log.warning("the memory plan is skipped: %s", UNKNOWN_MEMORY)
    elif problem := preflight(cfg, inventory, specs):
        if not force:
            raise ClusterError(problem + "\n  (or pass --force to start anyway)")
        log.warning("starting despite the memory plan (--force): %s", problem)
    try:
        model_path = resolve_model(cfg.model.name, quantization=cfg.model.quantization)
    except ModelNotFound as exc:
        raise ClusterError(str(exc)) from None
    address = zmq_address(cfg, specs)
    log.info(
        "Ray: workers reach the router at %s (CURVE); the model at %s must exist on every node", address, model_path
    )
    return RayLaunch(specs, model_path, address, RayBackend(cfg, specs), cfg)
