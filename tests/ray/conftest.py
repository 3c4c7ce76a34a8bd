"""The Ray tests' fixtures: a network namespace per module, and Ray's own multi-node test cluster
in it (``ray.cluster_utils.Cluster``: real raylets, declared fake GPUs, no dashboard, small object
stores). Everything a Ray test starts (the cluster, ``llamadeploy up``) runs inside the namespace,
where only loopback exists; the test's own HTTP calls are made from inside it too."""

from __future__ import annotations

import pytest

from launcher.ray_actor import sweep_folders
from tests.ray import netns

OBJECT_STORE_BYTES = 80 * 2**20
# Declared resources per node. Fast failure detection: a node whose raylet is killed is dead to the
# cluster after about health_check_period_ms × failure_threshold.
HEAD = {"num_cpus": 2, "num_gpus": 2}
SYSTEM_CONFIG = {"health_check_period_ms": 500, "health_check_failure_threshold": 2, "health_check_timeout_ms": 500}


@pytest.fixture(scope="module")
def namespace():
    """This module runs in a network namespace of its own (loopback only)."""
    pytest.importorskip("ray", reason="Ray is an optional extra: pip install -e '.[ray]' (scripts/setup.sh does)")
    try:
        handle = netns.enter()
    except OSError as exc:
        pytest.skip(f"the Ray tests need their own network namespace (root): {exc}")
    yield
    netns.leave(handle)


@pytest.fixture(scope="module")
def cluster(namespace):
    """A Ray cluster of one head node (2 CPUs, 2 fake GPUs); tests add nodes with :func:`add_node`."""
    from ray.cluster_utils import Cluster

    c = Cluster(
        initialize_head=True,
        head_node_args={
            **HEAD,
            "include_dashboard": False,
            "object_store_memory": OBJECT_STORE_BYTES,
            "_system_config": SYSTEM_CONFIG,
        },
    )
    yield c
    c.shutdown()
    sweep_folders()  # the private folders of actors that died with their node


def add_node(c, num_gpus: int, num_cpus: int = 2):
    """A worker node with ``num_gpus`` declared GPUs, registered before this returns."""
    return c.add_node(num_cpus=num_cpus, num_gpus=num_gpus, object_store_memory=OBJECT_STORE_BYTES, wait=True)
