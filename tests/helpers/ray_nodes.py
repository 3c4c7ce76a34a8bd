"""Ray test cluster nodes: declared resources, and adding a worker node."""

from __future__ import annotations

OBJECT_STORE_BYTES = 80 * 2**20

# Declared resources per node. Fast failure detection: a node whose raylet is killed is dead to the
# cluster after about health_check_period_ms × failure_threshold.
HEAD = {"num_cpus": 2, "num_gpus": 2}
SYSTEM_CONFIG = {"health_check_period_ms": 500, "health_check_failure_threshold": 2, "health_check_timeout_ms": 500}


def add_node(c, num_gpus: int, num_cpus: int = 2):
    """A worker node with ``num_gpus`` declared GPUs, registered before this returns."""
    return c.add_node(num_cpus=num_cpus, num_gpus=num_gpus, object_store_memory=OBJECT_STORE_BYTES, wait=True)
