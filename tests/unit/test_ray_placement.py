"""cluster.backend: ray without a cluster: the config keys and refusals, placement over nodes,
GPU sizing from a node's NVML (or the declared memory), the actor's private files."""

from __future__ import annotations

import os
import socket
import stat
from dataclasses import replace

import pytest

from launcher.config import ClusterConfig, ConfigError, parse_config
from launcher.plan.placement import PlacementError
from launcher.ray import cluster as ray_cluster
from launcher.ray.actor import FOLDER_PREFIX, sweep_folders, write_files
from launcher.ray.cluster import ClusterError, NodeInventory, _host_port, connect, node_gpus
from launcher.ray.placement import missing_room, place_on_cluster
from launcher.ray.up import unreachable
from tests.helpers.deployment import free_port
from worker.contract.settings import WorkersConfig
from worker.contract.units import GiB


def node(name: str, gpus: int, cpus: int = 8, head: bool = False) -> NodeInventory:
    return NodeInventory(name * 8, "10.0.0." + str(len(name)), cpus, gpus, node_gpus(gpus, [], 80), head)


HEAD, B, C = node("a", 2, head=True), node("bb", 1), node("ccc", 1)


def test_local_is_the_default_and_ray_keys_validate():
    assert parse_config({}).cluster == ClusterConfig(backend="local")
    cfg = parse_config({"cluster": {"backend": "ray", "address": "head:6379", "zmq_port": 9000}})
    assert (cfg.cluster.backend, cfg.cluster.address, cfg.cluster.router_host) == ("ray", "head:6379", "auto")


@pytest.mark.parametrize(
    ("data", "names"),
    [
        ({"router": {"zmq_address": "ipc:///tmp/x.ipc"}}, "router.zmq_address"),
        ({"workers": {"devices": [0, 1]}}, "workers.devices"),
        ({"workers": {"tensor_parallel_size": 2}}, "workers.tensor_parallel_size"),
    ],
)
def test_ray_refuses_what_cannot_cross_nodes(data, names):
    with pytest.raises(ConfigError) as err:
        parse_config({"cluster": {"backend": "ray"}, **data})
    assert names in str(err.value) and "cluster.backend" in str(err.value)
    parse_config(data)  # the same keys are fine locally


def test_gpu_replicas_spread_over_nodes_one_per_gpu():
    specs = place_on_cluster(WorkersConfig(replicas=3), ClusterConfig(), [HEAD, B, C])
    assert [(s.worker_id, s.node_id) for s in specs] == [(0, HEAD.node_id), (1, B.node_id), (2, C.node_id)]
    assert all(s.device == "cuda" and s.bundle == {"CPU": 1.0, "GPU": 1.0} for s in specs)
    assert all(s.gpu_info[0].total_bytes == 80 * GiB for s in specs)
    every = place_on_cluster(WorkersConfig(), ClusterConfig(), [HEAD, B, C])
    assert [s.node_id for s in every] == [HEAD.node_id, B.node_id, C.node_id, HEAD.node_id]


def test_too_many_replicas_is_refused_naming_the_slots():
    with pytest.raises(PlacementError) as err:
        place_on_cluster(WorkersConfig(replicas=5), ClusterConfig(), [HEAD, B, C])
    assert "workers.replicas=5" in str(err.value) and "only 4 replica slot(s)" in str(err.value)


def test_a_replica_never_spans_nodes():
    specs = place_on_cluster(WorkersConfig(gpus_per_replica=2), ClusterConfig(), [HEAD, B, C])
    assert [(s.node_id, s.bundle["GPU"]) for s in specs] == [(HEAD.node_id, 2.0)]
    with pytest.raises(PlacementError) as err:
        place_on_cluster(WorkersConfig(gpus_per_replica=4), ClusterConfig(), [HEAD, B, C])
    assert "gpus_per_replica=4" in str(err.value) and "cannot span nodes" in str(err.value)


def test_shared_gpus_get_a_fraction_and_cpus_cap_the_slots():
    specs = place_on_cluster(WorkersConfig(workers_per_gpu=2), ClusterConfig(cpus_per_worker=2), [node("a", 2, 6)])
    assert len(specs) == 3  # 4 shares of 2 GPUs, but 6 CPUs hold 3 workers of 2
    assert all(s.bundle == {"CPU": 2.0, "GPU": 0.5} and s.share == 0.5 for s in specs)


def test_cpu_replicas_spread_as_cpus_allow():
    cluster = ClusterConfig(cpus_per_worker=2)
    nodes = [node("a", 0, 4, head=True), node("bb", 0, 2)]
    auto = place_on_cluster(WorkersConfig(devices="cpu"), cluster, nodes)
    assert [(s.device, s.node_id, s.bundle) for s in auto] == [
        ("cpu", nodes[0].node_id, {"CPU": 2.0}),
        ("cpu", nodes[1].node_id, {"CPU": 2.0}),
    ]
    three = place_on_cluster(WorkersConfig(devices="cpu", replicas=3), cluster, nodes)
    assert [s.node_id for s in three] == [nodes[0].node_id, nodes[1].node_id, nodes[0].node_id]
    with pytest.raises(PlacementError, match=r"workers\.replicas=4"):
        place_on_cluster(WorkersConfig(devices="cpu", replicas=4), cluster, nodes)
    gpu_nodes_on_cpu = place_on_cluster(WorkersConfig(devices="cpu"), ClusterConfig(), [HEAD])
    assert [s.device for s in gpu_nodes_on_cpu] == ["cpu"]


def test_node_gpus_from_nvml_else_declared_else_unknown():
    nvml = [
        {"name": "H100", "total_bytes": 80 * GiB, "free_bytes": 79 * GiB, "capability": (9, 0)},
        {"name": "H100", "total_bytes": 80 * GiB, "free_bytes": 40 * GiB, "capability": (9, 0)},
    ]
    gpus = node_gpus(2, nvml, None)
    assert [(g.index, g.free_bytes, g.capability) for g in gpus] == [(0, 40 * GiB, (9, 0)), (1, 40 * GiB, (9, 0))]
    assert node_gpus(1, [], 24)[0].total_bytes == 24 * GiB
    unknown = NodeInventory("n" * 8, "10.0.0.9", 4, 1, node_gpus(1, [], None))
    assert not unknown.memory_known


def test_actor_files_are_private(tmp_path):
    write_files(tmp_path / "run", {"config.json": b"{}", "curve/worker-0.secret": b"k"})
    assert stat.S_IMODE((tmp_path / "run" / "curve").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "run" / "curve" / "worker-0.secret").stat().st_mode) == 0o600


def test_cluster_address_is_checked_before_ray_connects():
    with pytest.raises(ClusterError, match="not HOST:PORT"):
        _host_port("head-node")
    assert _host_port("ray://head:10001") == ("head", 10001)
    pytest.importorskip("ray")
    port = free_port()  # nothing listens there
    with pytest.raises(ClusterError) as err:
        connect(ClusterConfig(backend="ray", address=f"127.0.0.1:{port}"))
    assert f"cluster.address 127.0.0.1:{port}: no Ray cluster answers" in str(err.value)


def test_folders_of_dead_actors_are_swept(tmp_path):
    dead_pid = 4_194_305  # above the kernel's largest pid_max (2^22): never a live process
    mine = tmp_path / f"{FOLDER_PREFIX}{os.getpid()}-abc"
    gone = tmp_path / f"{FOLDER_PREFIX}{dead_pid}-def"
    for folder in (mine, gone):
        write_files(folder, {"curve/worker-0.secret": b"k"})
    assert sweep_folders(tmp_path) == [gone]
    assert mine.exists() and not gone.exists()


@pytest.mark.parametrize("address", ["head:abc", "head:99999", "http://head:8265", "https://head:6379"])
def test_a_malformed_cluster_address_is_one_line_not_a_traceback(address):
    with pytest.raises(ClusterError) as err:
        _host_port(address)
    assert f"cluster.address {address!r}" in str(err.value) and "6379" in str(err.value)


def test_a_port_where_something_else_listens_is_refused_before_ray_connects(monkeypatch):
    """A dashboard, an HTTP server or a silent service at cluster.address: ray.init would retry
    there for minutes; connect refuses at once (no gRPC answer)."""
    pytest.importorskip("ray")
    monkeypatch.setattr(ray_cluster, "CONNECT_CHECK_S", 0.5)
    monkeypatch.delenv("RAY_USE_TLS", raising=False)
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts (backlog), never answers
        port = silent.getsockname()[1]
        with pytest.raises(ClusterError) as err:
            connect(ClusterConfig(backend="ray", address=f"127.0.0.1:{port}"))
    assert f"cluster.address 127.0.0.1:{port}: something listens at 127.0.0.1:{port} but it is not Ray" in str(
        err.value
    )
    assert "\n" not in str(err.value)


def test_slots_beyond_the_free_resources_are_named_per_node():
    specs = place_on_cluster(WorkersConfig(replicas=3), ClusterConfig(), [HEAD, B, C])
    free = {HEAD.node_id: {"CPU": 8.0, "GPU": 2.0}, B.node_id: {"CPU": 7.0, "GPU": 1.0}, C.node_id: {"CPU": 8.0}}
    assert missing_room(specs, free) == f"{C.ip} ({C.node_id[:8]}) needs CPU 1, GPU 1, has CPU 8, GPU 0 free"
    free[C.node_id]["GPU"] = 1.0
    assert missing_room(specs, free) == ""
    shared = place_on_cluster(WorkersConfig(workers_per_gpu=3), ClusterConfig(), [node("a", 1)])
    assert missing_room(shared, {shared[0].node_id: {"CPU": 3.0, "GPU": 1.0}}) == ""  # 3 × 0.3333 fits


def test_a_router_address_the_nodes_cannot_reach_is_refused():
    """Workers connect to the address the router binds: 0.0.0.0 (or ZeroMQ's *) would have a remote
    node connect to itself, loopback reaches only this machine."""
    remote = place_on_cluster(WorkersConfig(replicas=2), ClusterConfig(), [HEAD, B])
    for host in ("0.0.0.0", "::", "*"):
        problem = unreachable(host, remote, "cluster.router_host")
        assert problem.startswith(f"cluster.router_host {host}: the workers connect to this address"), problem
        assert "cluster.router_host: auto" in problem
    assert "workers run on 10.0.0.1, 10.0.0.2" in unreachable("127.0.0.1", remote, "cluster.router_host")
    assert "drop router.zmq_address" in unreachable("localhost", remote, "router.zmq_address")
    assert unreachable("10.0.0.1", remote, "cluster.router_host") == ""
    assert unreachable("head.example", remote, "cluster.router_host") == ""
    one_machine = place_on_cluster(WorkersConfig(replicas=1), ClusterConfig(), [node("a", 1)])
    local = [replace(s, node_ip="127.0.0.1") for s in one_machine]  # Ray's test cluster: every node on loopback
    assert unreachable("127.0.0.1", local, "cluster.router_host") == ""


def test_up_refuses_slots_the_free_resources_cannot_hold_after_rereading(monkeypatch):
    from launcher.ray import up as ray_up

    specs = place_on_cluster(WorkersConfig(replicas=2), ClusterConfig(), [HEAD, B])
    taken = {HEAD.node_id: {"CPU": 8.0, "GPU": 2.0}, B.node_id: {"CPU": 8.0, "GPU": 0.0}}
    released = {**taken, B.node_id: {"CPU": 8.0, "GPU": 1.0}}
    reads = iter([taken, released])  # Ray's free figures catch up with a release
    monkeypatch.setattr(ray_up, "free_resources", lambda: next(reads))
    monkeypatch.setattr(ray_up.time, "sleep", lambda s: None)
    ray_up.check_room(specs, wait_s=5)
    monkeypatch.setattr(ray_up, "free_resources", lambda: taken)
    with pytest.raises(ClusterError) as err:
        ray_up.check_room(specs, wait_s=0)
    assert str(err.value).startswith("workers: the Ray cluster has no room now for 2 worker(s): 10.0.0.2 (bbbbbbbb)")
    assert "lower workers.replicas" in str(err.value)
