"""Placement: which worker runs on which GPUs or CPU cores. Pure logic over an :class:`Inventory`.

GPU indices in deploy.yaml are *physical*, as ``nvidia-smi`` and NVML number them (PCI bus
order). If the launcher itself runs under ``CUDA_VISIBLE_DEVICES`` (indices or ``GPU-`` UUIDs),
only those GPUs may be used and ``devices: auto`` means exactly them; they keep their physical
numbers here (the trap: under ``CUDA_VISIBLE_DEVICES=2,3`` a process calls them cuda:0 and 1).

Each worker gets ``CUDA_VISIBLE_DEVICES`` set to its own physical indices (with
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so CUDA numbers GPUs as NVML does), so inside the worker its GPUs
are ``cuda:0..n-1``. ``gpus_per_replica: N`` gives a replica N GPUs (the model is split layer-wise
across them); ``workers_per_gpu: N`` puts N replicas on each GPU group, each allowed ``1/N`` of it.
On CPU, the cores are split into disjoint sets, one per replica.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from dataclasses import dataclass, field

from launcher.config import WorkersConfig

log = logging.getLogger(__name__)

EXPECTED_GPUS_ENV = "LLAMADEPLOY_EXPECTED_GPUS"


class PlacementError(Exception):
    """The requested devices or replicas cannot be placed on this machine; says why and the fix."""


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as NVML reports it; ``index`` is physical (PCI bus order), memory in bytes."""

    index: int
    name: str
    uuid: str
    total_bytes: int
    free_bytes: int

    @property
    def used_bytes(self) -> int:
        return self.total_bytes - self.free_bytes


@dataclass(frozen=True)
class Inventory:
    """What this machine has: every GPU NVML lists (physical indices), the CPU cores of this
    process's affinity mask, available RAM in bytes (0 = unknown), and the launcher's inherited
    ``CUDA_VISIBLE_DEVICES`` (``None`` when unset)."""

    gpus: list[GpuInfo] = field(default_factory=list)
    cpus: list[int] = field(default_factory=list)
    visible_env: str | None = None
    ram_available_bytes: int = 0


@dataclass(frozen=True)
class WorkerSpec:
    """Where worker ``worker_id`` runs: ``gpus`` are physical indices, ``cpus`` its core set.

    ``gpu_info`` describes those GPUs (for the worker's start-up check); ``share`` is the fraction
    of each of its GPUs this worker may use (``1/k`` when k replicas share the GPUs).
    """

    worker_id: int
    device: str  # "cpu" | "cuda"
    gpus: tuple[int, ...] = ()
    cpus: tuple[int, ...] = ()
    gpu_info: tuple[GpuInfo, ...] = field(default=(), compare=False)
    share: float = 1.0

    @property
    def cuda_visible_devices(self) -> str:
        """The value for the worker's ``CUDA_VISIBLE_DEVICES`` ("" on CPU hides every GPU)."""
        return ",".join(str(g) for g in self.gpus)

    @property
    def label(self) -> str:
        if self.device == "cpu":
            return f"cpu[{','.join(map(str, self.cpus))}]"
        return f"cuda[{self.cuda_visible_devices}]"

    @property
    def env(self) -> dict[str, str]:
        """Environment the supervisor sets for this worker before it imports torch.

        ``LLAMADEPLOY_EXPECTED_GPUS`` is JSON ``{"share": f, "gpus": [{index, name, uuid,
        total_bytes}]}`` (empty on CPU); the worker compares it with what torch sees.
        """
        env = {"CUDA_VISIBLE_DEVICES": self.cuda_visible_devices, EXPECTED_GPUS_ENV: ""}
        if self.device == "cuda":
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
            gpus = [{"index": g.index, "name": g.name, "uuid": g.uuid, "total_bytes": g.total_bytes}
                    for g in self.gpu_info]
            env[EXPECTED_GPUS_ENV] = json.dumps({"share": self.share, "gpus": gpus})
        return env


def discover() -> Inventory:
    """Read GPUs through NVML (none when NVML or a driver is missing), this process's cores,
    available RAM and the inherited ``CUDA_VISIBLE_DEVICES``. Never raises."""
    cpus = sorted(os.sched_getaffinity(0))
    import psutil

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return Inventory(nvml_gpus(), cpus, visible, psutil.virtual_memory().available)


def nvml_gpus() -> list[GpuInfo]:
    """Every GPU NVML lists, in its (PCI bus) order; ``[]`` without NVML or a driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except ImportError as exc:
        log.debug("no NVML: %s", exc)
        return []
    except pynvml.NVMLError as exc:  # no driver / libnvidia-ml: a CPU machine
        log.debug("no NVML: %s", exc)
        return []
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            gpus.append(GpuInfo(i, _text(pynvml.nvmlDeviceGetName(h)), _text(pynvml.nvmlDeviceGetUUID(h)),
                                int(mem.total), int(mem.free)))
        return gpus
    except pynvml.NVMLError as exc:  # a GPU fallen off the bus makes NVML raise mid-way
        log.warning("NVML failed while listing GPUs: %s", exc)
        return []
    finally:
        pynvml.nvmlShutdown()


def _text(value: str | bytes) -> str:
    return value if isinstance(value, str) else value.decode()


def visible_gpus(inv: Inventory) -> list[GpuInfo]:
    """The GPUs the launcher may use, in order: all of ``inv.gpus``, or those the inherited
    ``CUDA_VISIBLE_DEVICES`` names (physical indices or unique ``GPU-`` UUID prefixes).

    As in CUDA, an empty value or a negative entry hides everything from there on. Without any
    GPU (no driver) the variable is ignored. Raises
    :class:`PlacementError` for an index or UUID NVML does not list, MIG entries or duplicates.
    """
    if inv.visible_env is None or not inv.gpus:
        return list(inv.gpus)
    by_index = {g.index: g for g in inv.gpus}
    chosen: list[GpuInfo] = []
    for entry in (e.strip() for e in inv.visible_env.split(",")):
        if not entry or (entry.lstrip("-").isdigit() and int(entry) < 0):
            break
        gpu = _match_visible_entry(entry, by_index, inv)
        if gpu in chosen:
            raise PlacementError(f"CUDA_VISIBLE_DEVICES={inv.visible_env} lists GPU {gpu.index} twice")
        chosen.append(gpu)
    return chosen


def _match_visible_entry(entry: str, by_index: dict[int, GpuInfo], inv: Inventory) -> GpuInfo:
    where = f"the launcher's CUDA_VISIBLE_DEVICES={inv.visible_env}"
    listed = ", ".join(f"{g.index} ({g.uuid})" for g in inv.gpus) or "no GPUs"
    if entry.isdigit():
        if int(entry) in by_index:
            return by_index[int(entry)]
        raise PlacementError(f"{where} names GPU {entry}, but NVML lists {listed}; fix or unset the variable")
    if entry.startswith("MIG-"):
        raise PlacementError(f"{where} names a MIG instance ({entry}); llamadeploy places whole GPUs only")
    matches = [g for g in inv.gpus if g.uuid.startswith(entry) or g.uuid.startswith("GPU-" + entry)]
    if len(matches) != 1:
        what = "matches no GPU" if not matches else "is ambiguous"
        raise PlacementError(f"{where}: {entry!r} {what}; NVML lists {listed}")
    return matches[0]


def place(cfg: WorkersConfig, inv: Inventory) -> list[WorkerSpec]:
    """Plan one :class:`WorkerSpec` per replica. Raises :class:`PlacementError`.

    GPU groups of ``gpus_per_replica`` consecutive GPUs (in ``devices`` order) each hold
    ``workers_per_gpu`` replica slots; replicas fill the slots round-robin over the groups, so
    ``replicas: 2`` with two groups uses both before doubling up. GPUs left over when the count
    does not divide by ``gpus_per_replica`` stay idle (logged).
    """
    if cfg.devices == "cpu":
        return _place_cpu(cfg, inv.cpus)
    allowed = visible_gpus(inv)
    if cfg.devices == "auto":
        if not allowed:
            return _place_cpu(cfg, inv.cpus)
        wanted = allowed
    else:
        wanted = _chosen_gpus(list(cfg.devices), allowed, inv)
    per = cfg.gpus_per_replica
    groups = [tuple(wanted[i : i + per]) for i in range(0, len(wanted), per)]
    groups = [g for g in groups if len(g) == per]
    names = [g.index for g in wanted]
    if not groups:
        raise PlacementError(f"workers.gpus_per_replica={per} but only {len(wanted)} GPU(s) {names} are available; "
                             f"lower gpus_per_replica or list more GPUs in workers.devices")
    if idle := names[len(groups) * per:]:
        log.warning("GPU(s) %s stay idle: %d GPUs do not divide into groups of gpus_per_replica=%d", idle, len(wanted), per)
    slots = [g for _ in range(cfg.workers_per_gpu) for g in groups]
    replicas = len(slots) if cfg.replicas == "auto" else cfg.replicas
    if replicas > len(slots):
        raise PlacementError(
            f"workers.replicas={replicas} but GPUs {names} give only {len(slots)} replica slot(s) "
            f"({len(groups)} group(s) of gpus_per_replica={per} × workers_per_gpu={cfg.workers_per_gpu}); "
            f"lower replicas, add GPUs to workers.devices, or raise workers_per_gpu to share GPUs")
    used = Counter(slots[:replicas])
    return [WorkerSpec(i, "cuda", gpus=tuple(g.index for g in slots[i]), gpu_info=slots[i], share=1 / used[slots[i]])
            for i in range(replicas)]


def _chosen_gpus(indices: list[int], allowed: list[GpuInfo], inv: Inventory) -> list[GpuInfo]:
    """Map deploy.yaml's physical ``indices`` to GPUs, with an error that explains the trap."""
    if len(set(indices)) != len(indices):
        raise PlacementError(f"workers.devices lists a GPU twice ({indices}); use workers_per_gpu to share a GPU")
    by_index = {g.index: g for g in allowed}
    missing = [i for i in indices if i not in by_index]
    if not missing:
        return [by_index[i] for i in indices]
    if not inv.gpus:
        raise PlacementError(f"workers.devices names GPU {missing} but this machine has no GPU that NVML can see "
                             "(no NVIDIA driver?); use devices: cpu, or auto to take whatever is there")
    physical = [g.index for g in inv.gpus]
    if inv.visible_env is not None and all(i in physical for i in missing):
        hint = ""
        if len(indices) <= len(allowed):
            hint = f"; did you mean devices: {[g.index for g in allowed[: len(indices)]]}?"
        raise PlacementError(
            f"workers.devices names GPU {missing}, hidden by the launcher's CUDA_VISIBLE_DEVICES={inv.visible_env} "
            f"(visible: physical GPUs {[g.index for g in allowed]}). Indices in deploy.yaml are physical, as "
            f"nvidia-smi numbers them, not the renumbered cuda:N a process sees{hint}")
    raise PlacementError(f"workers.devices names GPU {missing} but this machine has GPUs {physical}; "
                         "use devices: auto or indices from nvidia-smi")


def _place_cpu(cfg: WorkersConfig, cpus: list[int]) -> list[WorkerSpec]:
    replicas = 1 if cfg.replicas == "auto" else cfg.replicas
    if replicas > len(cpus):
        raise PlacementError(f"workers.replicas={replicas} CPU replicas need at least one core each, "
                             f"but only {len(cpus)} cores are available; lower replicas")
    per = len(cpus) // replicas
    return [WorkerSpec(i, "cpu", cpus=tuple(cpus[i * per : (i + 1) * per])) for i in range(replicas)]
