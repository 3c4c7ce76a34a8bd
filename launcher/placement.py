"""Placement: which worker runs on which GPUs or CPU cores. Pure logic over an :class:`Inventory`.

GPU indices in deploy.yaml are *physical* (as ``nvidia-smi`` numbers them). Each worker gets
``CUDA_VISIBLE_DEVICES`` set to its own physical indices, so inside the worker its GPUs are
``cuda:0..n-1``. On CPU, the cores are split into disjoint sets, one per replica.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from launcher.config import WorkersConfig


class PlacementError(Exception):
    """The requested devices or replicas cannot be placed on this machine; says why and the fix."""


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as NVML reports it; memory in bytes."""

    index: int
    name: str
    uuid: str
    total_bytes: int
    free_bytes: int


@dataclass(frozen=True)
class Inventory:
    """What the launcher may use: GPUs (physical indices) and the CPU cores of its affinity mask."""

    gpus: list[GpuInfo] = field(default_factory=list)
    cpus: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class WorkerSpec:
    """Where worker ``worker_id`` runs: ``gpus`` are physical indices, ``cpus`` its core set."""

    worker_id: int
    device: str  # "cpu" | "cuda"
    gpus: tuple[int, ...] = ()
    cpus: tuple[int, ...] = ()

    @property
    def cuda_visible_devices(self) -> str:
        """The value for the worker's ``CUDA_VISIBLE_DEVICES`` ("" on CPU hides every GPU)."""
        return ",".join(str(g) for g in self.gpus)

    @property
    def label(self) -> str:
        if self.device == "cpu":
            return f"cpu[{','.join(map(str, self.cpus))}]"
        return f"cuda[{self.cuda_visible_devices}]"


def discover() -> Inventory:
    """Read GPUs through NVML (none when NVML or a driver is missing) and this process's cores."""
    cpus = sorted(os.sched_getaffinity(0))
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return Inventory([], cpus)
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            name = pynvml.nvmlDeviceGetName(h)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            gpus.append(GpuInfo(i, name if isinstance(name, str) else name.decode(),
                                uuid if isinstance(uuid, str) else uuid.decode(), mem.total, mem.free))
        return Inventory(gpus, cpus)
    finally:
        pynvml.nvmlShutdown()


def place(cfg: WorkersConfig, inv: Inventory) -> list[WorkerSpec]:
    """Plan one :class:`WorkerSpec` per replica. Raises :class:`PlacementError`."""
    use_cpu = cfg.devices == "cpu" or (cfg.devices == "auto" and not inv.gpus)
    if use_cpu:
        return _place_cpu(cfg, inv.cpus)
    known = {g.index for g in inv.gpus}
    wanted = [g.index for g in inv.gpus] if cfg.devices == "auto" else list(cfg.devices)
    missing = [g for g in wanted if g not in known]
    if missing:
        raise PlacementError(f"workers.devices names GPU {missing} but this machine has "
                             f"{sorted(known) or 'no GPUs'}; use devices: auto or cpu")
    groups = [tuple(wanted[i : i + cfg.gpus_per_replica]) for i in range(0, len(wanted), cfg.gpus_per_replica)]
    groups = [g for g in groups if len(g) == cfg.gpus_per_replica]
    slots = [g for g in groups for _ in range(cfg.workers_per_gpu)]
    replicas = len(slots) if cfg.replicas == "auto" else cfg.replicas
    if replicas > len(slots) or not slots:
        raise PlacementError(
            f"workers.replicas={replicas} needs {replicas * cfg.gpus_per_replica} GPU slots "
            f"(gpus_per_replica={cfg.gpus_per_replica}, workers_per_gpu={cfg.workers_per_gpu}) but only "
            f"{len(slots)} are available on GPUs {wanted}; lower replicas or raise workers_per_gpu")
    return [WorkerSpec(i, "cuda", gpus=slots[i]) for i in range(replicas)]


def _place_cpu(cfg: WorkersConfig, cpus: list[int]) -> list[WorkerSpec]:
    replicas = 1 if cfg.replicas == "auto" else cfg.replicas
    if replicas > len(cpus):
        raise PlacementError(f"workers.replicas={replicas} CPU replicas need at least one core each, "
                             f"but only {len(cpus)} cores are available; lower replicas")
    per = len(cpus) // replicas
    return [WorkerSpec(i, "cpu", cpus=tuple(cpus[i * per : (i + 1) * per])) for i in range(replicas)]
