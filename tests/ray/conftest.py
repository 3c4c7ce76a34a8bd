"""The Ray tests' fixtures: a network namespace per module, and Ray's own multi-node test cluster
in it (``ray.cluster_utils.Cluster``: real raylets, declared fake GPUs, no dashboard, small object
stores). Everything a Ray test starts (the cluster, ``llamadeploy up``) runs inside the namespace,
where only loopback exists; the test's own HTTP calls are made from inside it too."""

from __future__ import annotations

import pytest

from launcher.ray.actor import sweep_folders
from tests.helpers import netns
from tests.helpers.ray_nodes import HEAD, OBJECT_STORE_BYTES, SYSTEM_CONFIG


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
