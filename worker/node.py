"""Where a worker runs, as its launcher told it: the cluster node and the GPUs the scheduler gave it.

Locally these are empty (the node is the launcher's own host). A worker placed by the Ray backend
(``cluster.backend: ray``) gets them from its actor, which reads them from Ray's runtime context
before the worker imports torch: ``LLAMADEPLOY_NODE_ID`` (Ray's hex node id),
``LLAMADEPLOY_NODE_IP`` and ``LLAMADEPLOY_RAY_GPU_IDS`` (``ray.get_gpu_ids()``, comma-separated).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from worker.contract.env import NODE_ID_ENV, NODE_IP_ENV, RAY_GPU_IDS_ENV


@dataclass(frozen=True)
class NodeIdentity:
    """``node_id`` and ``node_ip`` ("" when local), ``gpu_ids``: the GPU ids the cluster scheduler
    assigned (its numbering, which ``CUDA_VISIBLE_DEVICES`` carries; "" when none or local)."""

    node_id: str = ""
    node_ip: str = ""
    gpu_ids: str = ""

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> NodeIdentity:
        env = os.environ if env is None else env
        return cls(env.get(NODE_ID_ENV, ""), env.get(NODE_IP_ENV, ""), env.get(RAY_GPU_IDS_ENV, ""))

    def describe(self) -> str:
        """One log phrase, e.g. ``node 3f2a… (10.0.0.7), Ray GPU ids 0,1``; "" when local."""
        if not (self.node_id or self.node_ip):
            return ""
        gpus = f", Ray GPU ids {self.gpu_ids}" if self.gpu_ids else ""
        return f"node {self.node_id[:12]} ({self.node_ip}){gpus}"
