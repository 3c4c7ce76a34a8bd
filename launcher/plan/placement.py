"""Placement: which worker runs on which GPUs or CPU cores. Pure logic over an :class:`Inventory`.

GPU indices in deploy.yaml are *physical*, as ``nvidia-smi`` and NVML number them (PCI bus
order). If the launcher itself runs under ``CUDA_VISIBLE_DEVICES`` (indices or ``GPU-`` UUIDs),
only those GPUs may be used and ``devices: auto`` means exactly them; they keep their physical
numbers here (the trap: under ``CUDA_VISIBLE_DEVICES=2,3`` a process calls them cuda:0 and 1).

Each worker gets ``CUDA_VISIBLE_DEVICES`` set to its own physical indices (with
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so CUDA numbers GPUs as NVML does), so inside the worker its GPUs
are ``cuda:0..n-1``. ``gpus_per_replica: N`` gives a replica N GPUs (the model is split layer-wise
across them); ``tensor_parallel_size: N`` gives a replica N GPUs too, one rank process per GPU,
each rank seeing only its own (:meth:`WorkerSpec.rank_env`); ``workers_per_gpu: N`` puts N
replicas on each GPU group, each allowed ``1/N`` of it. On CPU, the cores are split into disjoint
sets, one per replica, and a tensor-parallel replica's set again between its ranks when it has
one core per rank at least (:meth:`WorkerSpec.rank_cpus`).

A GPU in MIG mode is placed by its MIG instances instead (``MIG-…`` UUIDs in the worker's
``CUDA_VISIBLE_DEVICES``, each with its own memory), one instance per replica, since CUDA gives a
process one MIG instance. When NVML cannot be read but CUDA can see GPUs (a container started with
``NVIDIA_DRIVER_CAPABILITIES=compute``), placement refuses rather than silently running on CPU.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field

from worker.contract.env import EXPECTED_GPUS_ENV, SLOT_DEVICE_ENV, expected_gpus_value
from worker.contract.settings import WorkersConfig
from worker.contract.units import GiB

log = logging.getLogger(__name__)


class PlacementError(Exception):
    """The requested devices or replicas cannot be placed on this machine; says why and the fix."""


@dataclass(frozen=True)
class GpuInfo:
    """One GPU, or one MIG instance, as NVML reports it; memory in bytes.

    ``index`` is the physical GPU (PCI bus order); a MIG instance keeps its GPU's index, has a
    ``MIG-…`` ``uuid`` and its own memory, and ``parent_uuid`` names the whole GPU.
    ``capability`` is CUDA's compute capability (major, minor), ``None`` when unknown.
    """

    index: int
    name: str
    uuid: str
    total_bytes: int
    free_bytes: int
    capability: tuple[int, int] | None = None
    parent_uuid: str = ""

    @property
    def used_bytes(self) -> int:
        return self.total_bytes - self.free_bytes

    @property
    def is_mig(self) -> bool:
        return self.uuid.startswith("MIG-")

    @property
    def cuda_id(self) -> str:
        """How ``CUDA_VISIBLE_DEVICES`` names it: the physical index, or the MIG UUID."""
        return self.uuid if self.is_mig else str(self.index)


@dataclass(frozen=True)
class GpuProblem:
    """A physical GPU NVML lists but could not be used: ``message`` names it and says why."""

    index: int
    message: str


@dataclass(frozen=True)
class Inventory:
    """What this machine has: every GPU (or MIG instance) NVML lists (physical indices), the CPU
    cores of this process's affinity mask, available RAM in bytes (0 = unknown), and the
    launcher's inherited ``CUDA_VISIBLE_DEVICES`` (``None`` when unset).

    ``gpu_problems`` are GPUs NVML lists but could not query; ``nvml_error`` says why NVML as a
    whole is unavailable ("" when it works); ``cuda_without_nvml`` is how many GPUs a CUDA probe
    saw in that case (0: a CPU machine). ``cpu_flags`` are ``/proc/cpuinfo``'s (for ``dtype: auto``).
    """

    gpus: list[GpuInfo] = field(default_factory=list)
    cpus: list[int] = field(default_factory=list)
    visible_env: str | None = None
    ram_available_bytes: int = 0
    gpu_problems: tuple[GpuProblem, ...] = ()
    nvml_error: str = ""
    cuda_without_nvml: int = 0
    cpu_flags: frozenset[str] = frozenset()


@dataclass(frozen=True)
class WorkerSpec:
    """Where worker ``worker_id`` runs: ``gpus`` are physical indices, ``cpus`` its core set.

    ``gpu_info`` describes those GPUs (for the worker's start-up check); ``share`` is the fraction
    of each of its GPUs this worker may use (``1/k`` when k replicas share the GPUs). ``tp`` is the
    tensor-parallel size: the slot is ``tp`` rank processes, rank ``r`` on GPU ``gpus[r]`` alone
    (:meth:`rank_env`) or on the CPU cores :meth:`rank_cpus`.
    """

    worker_id: int
    device: str  # "cpu" | "cuda"
    gpus: tuple[int, ...] = ()
    cpus: tuple[int, ...] = ()
    gpu_info: tuple[GpuInfo, ...] = field(default=(), compare=False)
    share: float = 1.0
    tp: int = 1
    model: int = 0  # which model of the deployment (launcher.config.DeployConfig.served) it serves

    @property
    def cuda_visible_devices(self) -> str:
        """The value for the worker's ``CUDA_VISIBLE_DEVICES`` ("" on CPU hides every GPU):
        physical indices, or the ``MIG-…`` UUID of a MIG instance."""
        if self.gpu_info:
            return ",".join(g.cuda_id for g in self.gpu_info)
        return ",".join(str(g) for g in self.gpus)

    @property
    def hardware(self) -> str:
        """What ``plan``'s placement tables show of the slot: each GPU's index, name and memory (and
        the share of it when replicas share it), or how many CPU cores it has."""
        if self.device != "cuda":
            return f"{len(self.cpus)} core(s)"
        share = "" if self.share == 1 else f", share 1/{round(1 / self.share)}"
        return "; ".join(f"{g.index}: {g.name} {g.total_bytes / GiB:.1f} GiB" for g in self.gpu_info) + share

    @property
    def label(self) -> str:
        """How ``status`` and ``GET /workers`` name the slot's devices: ``cpu[0,1]``, ``cuda[0,1]``,
        with `` (TP N)`` for a tensor-parallel slot."""
        if self.device == "cpu":
            where = f"cpu[{','.join(map(str, self.cpus))}]"
        elif any(g.is_mig for g in self.gpu_info):
            where = f"cuda[{','.join(f'{g.index}:{g.uuid[:12]}' for g in self.gpu_info)}]"
        else:
            where = f"cuda[{self.cuda_visible_devices}]"
        return where + (f" (TP {self.tp})" if self.tp > 1 else "")

    def rank_cpus(self, rank: int) -> tuple[int, ...]:
        """Rank ``rank``'s cores: a disjoint ``1/tp`` of the slot's cores when there is at least one
        per rank (a remainder goes to the last rank), else all of them, shared by every rank."""
        if self.tp <= 1 or len(self.cpus) < self.tp:
            return self.cpus
        per = len(self.cpus) // self.tp
        return self.cpus[rank * per : (rank + 1) * per if rank < self.tp - 1 else len(self.cpus)]

    def rank_env(self, rank: int) -> dict[str, str]:
        """:attr:`env` for rank ``rank`` of a tensor-parallel slot: only its own GPU is visible, and
        :data:`SLOT_DEVICE_ENV` names the whole slot (rank 0 reports it as its device)."""
        if self.tp <= 1:
            return self.env
        if self.device != "cuda":
            return {**self.env, SLOT_DEVICE_ENV: self.label}
        one = WorkerSpec(
            self.worker_id, self.device, self.gpus[rank : rank + 1], (), self.gpu_info[rank : rank + 1], self.share
        )
        return {**one.env, SLOT_DEVICE_ENV: self.label}

    @property
    def env(self) -> dict[str, str]:
        """Environment the supervisor sets for this worker before it imports torch.

        ``LLAMADEPLOY_EXPECTED_GPUS`` (:func:`worker.contract.env.expected_gpus_value`; empty on
        CPU) says which GPUs the worker should see; it compares them with what torch sees.
        """
        env = {"CUDA_VISIBLE_DEVICES": self.cuda_visible_devices, EXPECTED_GPUS_ENV: ""}
        if self.device == "cuda":
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
            env[EXPECTED_GPUS_ENV] = expected_gpus_value(self.gpu_info, self.share)
        return env


def discover() -> Inventory:
    """Read GPUs through NVML, this process's cores, available RAM, the inherited
    ``CUDA_VISIBLE_DEVICES`` and the CPU flags. When NVML is unavailable, a subprocess probe asks
    the CUDA driver how many GPUs it sees (so :func:`place` can refuse a silent CPU fallback).
    Never raises."""
    import psutil

    from worker.contract.dtypes import cpu_flags

    scan = nvml_scan()
    probe = cuda_probe() if scan.error else 0
    return Inventory(
        scan.gpus,
        sorted(os.sched_getaffinity(0)),
        os.environ.get("CUDA_VISIBLE_DEVICES"),
        psutil.virtual_memory().available,
        tuple(scan.problems),
        scan.error,
        probe,
        cpu_flags(),
    )


@dataclass(frozen=True)
class NvmlScan:
    """What NVML listed: usable ``gpus`` (whole GPUs and MIG instances), ``problems`` per GPU,
    and ``error`` when NVML itself is unavailable ("" when it works)."""

    gpus: list[GpuInfo] = field(default_factory=list)
    problems: list[GpuProblem] = field(default_factory=list)
    error: str = ""


def nvml_gpus() -> list[GpuInfo]:
    """Every usable GPU (or MIG instance) NVML lists, in PCI bus order; ``[]`` without NVML."""
    return nvml_scan().gpus


def nvml_scan(nvml=None) -> NvmlScan:
    """Query NVML (``nvml`` is the ``pynvml`` module, or a stand-in with its API in tests).

    Errors are caught per GPU, and each names its GPU; a GPU in MIG mode is listed by its MIG
    instances (a problem when it has none). Never raises.
    """
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError as exc:
            return NvmlScan(error=f"nvidia-ml-py is not installed ({exc})")
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:  # no driver / no libnvidia-ml: a CPU machine, or a container without it
        log.debug("no NVML: %s", exc)
        return NvmlScan(error=f"NVML unavailable: {exc}")
    try:
        count = nvml.nvmlDeviceGetCount()
    except nvml.NVMLError as exc:
        nvml.nvmlShutdown()
        return NvmlScan(error=f"NVML cannot count the GPUs: {exc}")
    scan = NvmlScan()
    try:
        for i in range(count):
            try:
                gpus, problem = _read_gpu(nvml, i, nvml.nvmlDeviceGetHandleByIndex(i))
            except nvml.NVMLError as exc:  # e.g. a GPU fallen off the bus
                gpus, problem = [], GpuProblem(i, f"NVML cannot query GPU {i}: {exc}")
            scan.gpus.extend(gpus)
            if problem:
                log.warning("%s", problem.message)
                scan.problems.append(problem)
    finally:
        nvml.nvmlShutdown()
    return scan


def _read_gpu(nvml, index: int, handle) -> tuple[list[GpuInfo], GpuProblem | None]:
    name, uuid = _text(nvml.nvmlDeviceGetName(handle)), _text(nvml.nvmlDeviceGetUUID(handle))
    mem = nvml.nvmlDeviceGetMemoryInfo(handle)
    capability = tuple(int(v) for v in nvml.nvmlDeviceGetCudaComputeCapability(handle))
    whole = GpuInfo(index, name, uuid, int(mem.total), int(mem.free), capability)
    try:
        current, _pending = nvml.nvmlDeviceGetMigMode(handle)
    except nvml.NVMLError:  # NotSupported on GPUs without MIG
        return [whole], None
    if current != getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1):
        return [whole], None
    instances = []
    for j in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, j)
        except nvml.NVMLError:  # NotFound: no instance in this slot
            continue
        mem = nvml.nvmlDeviceGetMemoryInfo(mig)
        instances.append(
            GpuInfo(
                index,
                _text(nvml.nvmlDeviceGetName(mig)),
                _text(nvml.nvmlDeviceGetUUID(mig)),
                int(mem.total),
                int(mem.free),
                capability,
                parent_uuid=uuid,
            )
        )
    if not instances:
        return [], GpuProblem(
            index,
            f"GPU {index} ({name}) is in MIG mode but has no MIG instances: create them "
            f"(nvidia-smi mig -i {index} -cgi <profile> -C) or disable MIG "
            f"(nvidia-smi -i {index} -mig 0; MIG rarely pays for 7B+ models)",
        )
    return instances, None


CUDA_PROBE = """
import ctypes, sys
try:
    cuda = ctypes.CDLL("libcuda.so.1")
except OSError:
    print(0); sys.exit()
n = ctypes.c_int(0)
ok = cuda.cuInit(0) == 0 and cuda.cuDeviceGetCount(ctypes.byref(n)) == 0
print(n.value if ok else 0)
"""


def cuda_probe(timeout_s: float = 30.0) -> int:
    """How many GPUs the CUDA driver (``libcuda``, not NVML) sees, asked in a subprocess so this
    process never initialises CUDA before it forks workers; 0 when none or on any failure."""
    try:
        out = subprocess.run(
            [sys.executable, "-c", CUDA_PROBE], capture_output=True, text=True, timeout=timeout_s, check=False
        )
        return int(out.stdout.strip() or 0)
    except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
        log.debug("CUDA probe failed: %s", exc)
        return 0


def _text(value: str | bytes) -> str:
    return value if isinstance(value, str) else value.decode()


def visible_gpus(inv: Inventory) -> list[GpuInfo]:
    """The GPUs (or MIG instances) the launcher may use, in order: all of ``inv.gpus``, or those
    the inherited ``CUDA_VISIBLE_DEVICES`` names (physical indices, unique ``GPU-`` UUID prefixes,
    or ``MIG-`` UUIDs; an index of a GPU in MIG mode means all its instances).

    As in CUDA, an empty value or a negative entry hides everything from there on. Without any
    GPU (no driver) the variable is ignored. Raises :class:`PlacementError` for an index or UUID
    NVML does not list (naming the NVML error when that GPU could not be queried) or duplicates.
    """
    if inv.visible_env is None or not (inv.gpus or inv.gpu_problems):
        return list(inv.gpus)
    chosen: list[GpuInfo] = []
    for entry in (e.strip() for e in inv.visible_env.split(",")):
        if not entry or (entry.lstrip("-").isdigit() and int(entry) < 0):
            break
        for gpu in _match_visible_entry(entry, inv):
            if gpu in chosen:
                raise PlacementError(f"CUDA_VISIBLE_DEVICES={inv.visible_env} lists GPU {gpu.index} twice")
            chosen.append(gpu)
    return chosen


def _match_visible_entry(entry: str, inv: Inventory) -> list[GpuInfo]:
    where = f"the launcher's CUDA_VISIBLE_DEVICES={inv.visible_env}"
    listed = ", ".join(f"{g.index} ({g.uuid})" for g in inv.gpus) or "no GPUs"
    if entry.isdigit():
        if found := [g for g in inv.gpus if g.index == int(entry)]:
            return found
        if problem := _problem(inv, int(entry)):
            raise PlacementError(f"{where} names GPU {entry}, which cannot be used: {problem}")
        raise PlacementError(f"{where} names GPU {entry}, but NVML lists {listed}; fix or unset the variable")
    matches = [g for g in inv.gpus if g.uuid.startswith(entry) or g.uuid.startswith("GPU-" + entry)]
    if len(matches) != 1:
        what = "matches no GPU" if not matches else "is ambiguous"
        if entry.startswith("MIG-") and not matches:
            what = "matches no MIG instance"
        raise PlacementError(f"{where}: {entry!r} {what}; NVML lists {listed}")
    return matches


def _problem(inv: Inventory, index: int) -> str:
    return next((p.message for p in inv.gpu_problems if p.index == index), "")


def nvml_missing_error(inv: Inventory) -> str:
    """The message when NVML is unavailable but CUDA sees GPUs ("" otherwise)."""
    if not inv.cuda_without_nvml:
        return ""
    return (
        f"CUDA sees {inv.cuda_without_nvml} GPU(s) but NVML cannot be read ({inv.nvml_error}), so llamadeploy "
        "cannot place workers on them. In a container, start it with NVIDIA_DRIVER_CAPABILITIES=compute,utility "
        "(or all) so libnvidia-ml.so.1 is mounted; on a host, install the driver's NVML library "
        "(it comes with the driver; `nvidia-smi` must work). To run on CPU on purpose, set workers.devices: cpu"
    )


def place(cfg: WorkersConfig, inv: Inventory) -> list[WorkerSpec]:
    """Plan one :class:`WorkerSpec` per replica. Raises :class:`PlacementError`.

    GPU groups of ``gpus_per_replica`` (or ``tensor_parallel_size``: one rank per GPU)
    consecutive GPUs (in ``devices`` order) each hold ``workers_per_gpu`` replica slots; replicas
    fill the slots round-robin over the groups, so ``replicas: 2`` with two groups uses both
    before doubling up. GPUs left over when the count does not divide by the group size stay idle
    (logged). A GPU in MIG mode contributes its MIG instances, each one group (the group size
    must then be 1). ``devices: auto`` refuses when NVML is missing but CUDA sees GPUs, or when a
    GPU could not be queried.
    """
    if cfg.devices == "cpu":
        return _place_cpu(cfg, inv.cpus)
    if message := nvml_missing_error(inv):
        raise PlacementError(message)
    allowed = visible_gpus(inv)
    if cfg.devices == "auto":
        _refuse_unqueried(inv, allowed)
        if not allowed:
            return _place_cpu(cfg, inv.cpus)
        wanted = allowed
    else:
        wanted = _chosen_gpus(list(cfg.devices), allowed, inv)
    tp = cfg.tensor_parallel_size
    per = cfg.gpus_per_slot
    key = "tensor_parallel_size" if tp > 1 else "gpus_per_replica"
    if tp > 1 and (mig := sorted({g.index for g in wanted if g.is_mig})):
        raise PlacementError(
            f"GPU(s) {mig} are in MIG mode, and NCCL cannot run tensor parallelism across MIG instances; "
            "use workers.tensor_parallel_size: 1 (one replica per MIG instance), or disable MIG (nvidia-smi -i N -mig 0)"
        )
    if per > 1 and (mig := sorted({g.index for g in wanted if g.is_mig})):
        raise PlacementError(
            f"GPU(s) {mig} are in MIG mode and CUDA gives a process only one MIG instance, so "
            f"gpus_per_replica={per} cannot span them; use gpus_per_replica: 1 (one replica per MIG "
            "instance), or disable MIG (nvidia-smi -i N -mig 0) for a layer split"
        )
    groups = [tuple(wanted[i : i + per]) for i in range(0, len(wanted), per)]
    groups = [g for g in groups if len(g) == per]
    names = [g.index for g in wanted]
    if not groups:
        raise PlacementError(
            f"workers.{key}={per} but only {len(wanted)} GPU(s) {names} are available; "
            f"lower {key} or list more GPUs in workers.devices"
        )
    if idle := names[len(groups) * per :]:
        log.warning("GPU(s) %s stay idle: %d GPUs do not divide into groups of %s=%d", idle, len(wanted), key, per)
    slots = [g for _ in range(cfg.workers_per_gpu) for g in groups]
    replicas = len(slots) if cfg.replicas == "auto" else cfg.replicas
    if replicas > len(slots):
        raise PlacementError(
            f"workers.replicas={replicas} but GPUs {names} give only {len(slots)} replica slot(s) "
            f"({len(groups)} group(s) of {key}={per} × workers_per_gpu={cfg.workers_per_gpu}); "
            f"lower replicas, add GPUs to workers.devices, or raise workers_per_gpu to share GPUs"
        )
    used = Counter(slots[:replicas])
    return [
        WorkerSpec(i, "cuda", gpus=tuple(g.index for g in slots[i]), gpu_info=slots[i], share=1 / used[slots[i]], tp=tp)
        for i in range(replicas)
    ]


def _refuse_unqueried(inv: Inventory, allowed: list[GpuInfo]) -> None:
    """``devices: auto`` must not quietly leave out a GPU NVML could not query (unless the
    inherited ``CUDA_VISIBLE_DEVICES`` already leaves it out)."""
    if not inv.gpu_problems:
        return
    if inv.visible_env is not None:
        named = {int(e) for e in inv.visible_env.split(",") if e.strip().isdigit()}
        problems = [p for p in inv.gpu_problems if p.index in named]
    else:
        problems = list(inv.gpu_problems)
    if problems:
        keep = sorted({g.index for g in allowed})
        leave_out = f" or leave it out: workers.devices: {keep}" if keep else ""
        raise PlacementError(
            "; ".join(p.message for p in problems) + f". Fix it (nvidia-smi -q -i N shows its state){leave_out}"
        )


def _chosen_gpus(indices: list[int], allowed: list[GpuInfo], inv: Inventory) -> list[GpuInfo]:
    """Map deploy.yaml's physical ``indices`` to GPUs (all MIG instances of a GPU in MIG mode),
    with an error that explains the trap."""
    if len(set(indices)) != len(indices):
        raise PlacementError(f"workers.devices lists a GPU twice ({indices}); use workers_per_gpu to share a GPU")
    allowed_indices = {g.index for g in allowed}
    missing = [i for i in indices if i not in allowed_indices]
    if not missing:
        return [g for i in indices for g in allowed if g.index == i]
    if problems := [_problem(inv, i) for i in missing if _problem(inv, i)]:
        raise PlacementError(f"workers.devices names GPU {missing}, which cannot be used: " + "; ".join(problems))
    if not inv.gpus:
        raise PlacementError(
            f"workers.devices names GPU {missing} but this machine has no GPU that NVML can see "
            "(no NVIDIA driver?); use devices: cpu, or auto to take whatever is there"
        )
    physical = sorted({g.index for g in inv.gpus})
    if inv.visible_env is not None and all(i in physical for i in missing):
        hint = ""
        visible = sorted({g.index for g in allowed}, key=[g.index for g in allowed].index)
        if len(indices) <= len(visible):
            hint = f"; did you mean devices: {visible[: len(indices)]}?"
        raise PlacementError(
            f"workers.devices names GPU {missing}, hidden by the launcher's CUDA_VISIBLE_DEVICES={inv.visible_env} "
            f"(visible: physical GPUs {visible}). Indices in deploy.yaml are physical, as "
            f"nvidia-smi numbers them, not the renumbered cuda:N a process sees{hint}"
        )
    raise PlacementError(
        f"workers.devices names GPU {missing} but this machine has GPUs {physical}; "
        "use devices: auto or indices from nvidia-smi"
    )


def _place_cpu(cfg: WorkersConfig, cpus: list[int]) -> list[WorkerSpec]:
    replicas = 1 if cfg.replicas == "auto" else cfg.replicas
    if replicas > len(cpus):
        raise PlacementError(
            f"workers.replicas={replicas} CPU replicas need at least one core each, "
            f"but only {len(cpus)} cores are available; lower replicas"
        )
    per = len(cpus) // replicas
    tp = cfg.tensor_parallel_size
    if tp > 1 and per < tp:
        log.warning(
            "%d core(s) per replica for tensor_parallel_size=%d: the ranks of a replica share their cores", per, tp
        )
    return [WorkerSpec(i, "cpu", cpus=tuple(cpus[i * per : (i + 1) * per]), tp=tp) for i in range(replicas)]
