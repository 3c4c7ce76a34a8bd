"""The environment variables the launcher sets for its children: their names' one home.

Settings travel in the child's settings file; the environment carries only what must be known
before that file is read, or what a library reads from the environment itself.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

KEYS_ENV = "LLAMADEPLOY_CURVE_KEYS"  # the folder of this deployment's CURVE keys (router and worker children)
PARENT_ENV = "LLAMADEPLOY_PARENT_PID"  # the supervisor's pid: the child dies with it (worker.contract.lifeline)
EXPECTED_GPUS_ENV = "LLAMADEPLOY_EXPECTED_GPUS"  # JSON: the GPUs placement expects this worker to see, and its share
SLOT_DEVICE_ENV = "LLAMADEPLOY_SLOT_DEVICE"  # a tensor-parallel rank: the whole slot's label, for its Hello
NODE_ID_ENV = "LLAMADEPLOY_NODE_ID"  # Ray's hex node id of the worker's node (empty locally)
NODE_IP_ENV = "LLAMADEPLOY_NODE_IP"  # that node's address
RAY_GPU_IDS_ENV = "LLAMADEPLOY_RAY_GPU_IDS"  # ray.get_gpu_ids(), comma-separated
API_KEYS_ENV = "LLAMADEPLOY_API_KEYS"  # the launcher's own: comma-separated router.api_keys
ADMIN_TOKEN_ENV = "LLAMADEPLOY_ADMIN_TOKEN"  # the launcher's own: router.admin_token
CACHE_ENV = "LLAMADEPLOY_CACHE"  # the root of what is cached across runs: converted models, built operators
TUNING_ENV = "LLAMADEPLOY_TUNING_DIR"  # where start-up timings are kept (worker.start_cache); default under CACHE_ENV
SECRET_ENVS = frozenset(
    {API_KEYS_ENV, ADMIN_TOKEN_ENV}
)  # never passed on to a child (the router's settings file has them)


def expected_gpus_value(gpus: Iterable, share: float) -> str:
    """The value of :data:`EXPECTED_GPUS_ENV` for a worker placed on ``gpus`` (objects with
    ``index``, ``name``, ``uuid``, ``total_bytes`` and ``parent_uuid``, as
    ``launcher.plan.placement.GpuInfo``) with ``share`` of each: JSON ``{"share": f, "gpus":
    [{index, name, uuid, total_bytes, parent_uuid}]}``. The worker compares it with what torch sees."""
    fields = ("index", "name", "uuid", "total_bytes", "parent_uuid")
    return json.dumps({"share": share, "gpus": [{f: getattr(g, f) for f in fields} for g in gpus]})


def expected_from_env(environ: Mapping[str, str] | None = None) -> dict | None:
    """The launcher's intent as :func:`expected_gpus_value` wrote it, or ``None`` when not set
    (a CPU worker, or one started by hand)."""
    raw = (environ if environ is not None else os.environ).get(EXPECTED_GPUS_ENV, "")
    return json.loads(raw) if raw else None


def cache_root() -> Path:
    """The root of what llamadeploy caches across runs (converted models, built operators):
    ``$LLAMADEPLOY_CACHE``, else ``~/.cache/llamadeploy``."""
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "llamadeploy"))


def tuning_dir() -> Path:
    """Where a worker keeps what it measured at start for the next start on this machine (its
    kernel tables and step costs, :mod:`worker.start_cache`): ``$LLAMADEPLOY_TUNING_DIR``, else
    :func:`cache_root` ``/tuning``."""
    return Path(os.environ.get(TUNING_ENV) or cache_root() / "tuning")
