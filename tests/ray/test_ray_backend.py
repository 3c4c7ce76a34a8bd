"""cluster.backend: ray end to end, on Ray's multi-node test cluster inside this module's network
namespace: placement on (node, GPU) pairs, a kill -9 of a worker's actor, a node that leaves.

The cluster: the head (2 fake GPUs), node B (1) and node C (1); ``replicas: 3`` puts one worker on
each node. The GPUs are declared, not real: ``LLAMADEPLOY_TEST_GPUS_ON_CPU`` has the workers
compute on CPU while Ray still assigns them GPUs and sets their ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from launcher.ray.backend import GPUS_ON_CPU_ENV
from tests.helpers.deployment import Deployment, free_port, wait_for
from tests.helpers.ray_nodes import add_node

HEARTBEAT_TIMEOUT_S = 4.0


def proc_env(pid: int) -> dict[str, str]:
    """The environment process ``pid`` started with (every node of the test cluster is this machine)."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        items = [e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e]
    return {k.decode(): v.decode() for k, v in items}


def parent_pid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


@pytest.fixture(scope="module")
def nodes(cluster):
    """The cluster's nodes by name: head (2 GPUs), b and c (1 GPU each)."""
    return {"head": cluster.head_node, "b": add_node(cluster, 1), "c": add_node(cluster, 1)}


@pytest.fixture(scope="module")
def deployment(cluster, nodes, tmp_path_factory):
    d = Deployment(
        tmp_path_factory.mktemp("ray"),
        {
            "cluster": {
                "backend": "ray",
                "address": cluster.address,
                "zmq_port": free_port(),
                "gpu_memory_gib": 16,  # the declared GPUs have no NVML behind them
                # A new actor's Python start on a loaded 2-core box can pass 10 s: three busy loops beside
                # this module made every start of worker 2 time out at 10 s (crashes counted, then failed).
                "placement_timeout_s": 30,
            },
            "workers": {"devices": "auto", "replicas": 3, "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S},
        },
        env={GPUS_ON_CPU_ENV: "1", "RAY_ADDRESS": ""},
    )
    d.start(timeout=120)
    yield d
    assert d.stop() == 0, d.log()[-3000:]


def test_up_without_a_reachable_cluster_exits_2_with_one_line(namespace, tmp_path):
    port = free_port()  # nothing listens there
    d = Deployment(tmp_path, {"cluster": {"backend": "ray", "address": f"127.0.0.1:{port}"}})
    d.path.write_text(json.dumps(d.config))
    out = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "up", str(d.path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "RAY_ADDRESS": ""},
    )
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    assert f"cluster.address 127.0.0.1:{port}" in lines[0] and "ray start --head" in lines[0]


def test_each_worker_gets_its_own_node_and_gpu_and_answers(deployment, nodes):
    workers = deployment.workers()
    assert [w["state"] for w in workers] == ["ready"] * 3
    placed = []
    for w in workers:
        env = proc_env(w["pid"])  # the worker's environment, as its actor gave it
        assert env["LLAMADEPLOY_NODE_ID"] == w["node_id"]
        assert env["LLAMADEPLOY_NODE_IP"] == w["node_ip"] == "127.0.0.1"
        assert env["CUDA_VISIBLE_DEVICES"] == env["LLAMADEPLOY_RAY_GPU_IDS"] == w["gpu_ids"]
        assert len(w["gpu_ids"].split(",")) == 1
        placed.append((w["node_id"], w["gpu_ids"]))
    assert len(set(placed)) == 3  # distinct (node, GPU) pairs
    assert {node for node, _ in placed} == {n.node_id for n in nodes.values()}  # one worker on each node
    answers = [deployment.chat("What is the capital of France? Answer in one word.", max_tokens=8) for _ in range(3)]
    for r in answers:
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
    served = {w["id"]: w["served"] for w in deployment.workers()}
    assert sum(served.values()) >= 3


def test_restart_worker_with_drain_comes_back_in_its_bundle(deployment):
    before = deployment.worker(0)
    cli = [sys.executable, "-m", "launcher.cli", "restart-worker", "0", "--drain", "--config", str(deployment.path)]
    out = subprocess.run(
        [*cli, "--admin-url", deployment.admin_url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    after = deployment.worker(0)
    assert after["state"] == "ready" and after["pid"] != before["pid"]
    assert (after["node_id"], after["gpu_ids"]) == (before["node_id"], before["gpu_ids"])


def test_kill_9_of_a_worker_actor_restarts_it_on_its_node(deployment):
    target = deployment.worker(2)
    old_pid, node = target["pid"], target["node_id"]
    actor_pid = parent_pid(old_pid)
    with open(f"/proc/{actor_pid}/cmdline", "rb") as f:
        assert b"WorkerActor" in f.read()  # the worker's parent is its Ray actor
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(deployment.chat, f"Count from 1 to 30, request {i}.", max_tokens=48) for i in range(6)]
        wait_for(lambda: deployment.worker(2)["in_flight"] > 0, 60, what="a request in flight on worker 2")
        os.kill(actor_pid, signal.SIGKILL)
        results = [f.result() for f in futures]
    for r in results:
        assert r.status_code == 200, r.text  # retried or migrated to another worker
    w = wait_for(
        lambda: (x := deployment.worker(2))["state"] == "ready" and x["pid"] != old_pid and x,
        90,
        what="worker 2 restarted",
    )
    assert w["node_id"] == node  # its bundle is on the same node
    lines = [x for x in deployment.log().splitlines() if "worker 2" in x]
    assert w["restarts"] == 1, "\n".join(lines[-30:])  # one kill, one restart: the log says what else happened
    status = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "status", "--json", "--admin-url", deployment.admin_url],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    row = next(x for x in json.loads(status.stdout)["workers"] if x["id"] == 2)
    assert row["restarts"] == 1 and row["node_id"] == node
    assert "worker 2" in deployment.log() and "killed by SIGKILL" in deployment.log()


def test_a_node_that_leaves_has_its_workers_replaced_or_failed(deployment, cluster, nodes):
    by_node = {w["node_id"]: w for w in deployment.workers()}
    b, c = by_node[nodes["b"].node_id], by_node[nodes["c"].node_id]

    # Node B leaves: the head has a free GPU, so its worker comes back there.
    cluster.remove_node(nodes["b"], allow_graceful=False)
    wait_for(
        lambda: deployment.worker(b["id"])["state"] != "ready",
        HEARTBEAT_TIMEOUT_S + 2,
        what=f"worker {b['id']} marked dead",
    )
    moved = wait_for(
        lambda: (x := deployment.worker(b["id"]))["state"] == "ready" and x,
        90,
        what=f"worker {b['id']} re-placed",
    )
    assert moved["node_id"] == nodes["head"].node_id

    # Node C leaves: no node has a free GPU now, so its worker is failed with the reason.
    cluster.remove_node(nodes["c"], allow_graceful=False)
    failed = wait_for(
        lambda: (x := deployment.worker(c["id"]))["state"] == "failed" and x,
        60,
        what=f"worker {c['id']} failed",
    )
    assert "left the cluster" in failed["exit_reason"] and "no other node has room" in failed["exit_reason"]
    assert "restart-worker" in failed["exit_reason"]
    r = deployment.chat("What is the capital of France? Answer in one word.", max_tokens=8)
    assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"]
