"""The KV-cache budget of one GPU worker: one rule for ``llamadeploy plan`` and the worker (torch-free).

Per GPU ``i`` the worker holds, besides its KV cache, the weights on that GPU, the transient
activation peak of one prefill step, and an allowance for what torch's allocator does not count
(the CUDA context, cuBLAS/NCCL workspaces, allocator fragmentation). Its KV room there is the
smaller of

* its own ceiling: ``total × gpu_memory_utilization × share − weights − activation peak − allowance``,
* what the device still has: ``free − total × (1 − gpu_memory_utilization) − activation peak``,
  less the weights and allowance when they are not loaded yet (``plan``'s case). Other processes
  (and co-tenant replicas already running) are outside ``free``.

A token costs ``kv_bytes_per_token × (fraction of the layers on GPU i)``; the tightest GPU bounds
the tokens, and every GPU then allocates exactly ``tokens × its per-token bytes`` once, before
serving, never growing (growing would hold the old and the new buffer at once).

The worker measures its facts after warm-up, as nano-vllm's ``warmup_model`` →
``allocate_kv_cache`` does: ``reset_peak_memory_stats()``, one forward of ``max_prefill_tokens``,
``empty_cache()``; then weights = ``memory_allocated()``, peak = ``max_memory_allocated() −
memory_allocated()``, free from ``mem_get_info()`` (see ``worker.gpus.measure_gpus``). ``plan``
supplies NVML's free memory and its estimates of the same terms (``launcher.plan.plan``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from worker.contract.units import GiB

GPU_ALLOWANCE_BYTES = GiB  # CUDA context (0.3 to 0.6 GiB) + cuBLAS workspace + fragmentation


@dataclass(frozen=True)
class GpuFacts:
    """What one GPU holds for this worker, in bytes.

    ``free_bytes`` is device-wide free memory now. ``resident`` says the weights and the CUDA
    context are already loaded (the worker after warm-up), so they are no longer part of
    ``free_bytes``; ``False`` (``plan``, before loading) subtracts them from it. ``layer_fraction``
    is the share of the decoder layers (so of the KV cache) on this GPU.
    """

    total_bytes: int
    free_bytes: int
    weights_bytes: int
    activation_peak_bytes: int
    layer_fraction: float = 1.0
    resident: bool = False


@dataclass(frozen=True)
class GpuKv:
    """The outcome on one GPU: ``room`` bytes usable for KV, ``bytes`` to allocate for it, what
    bounds the room (``"share"`` = this worker's ceiling, ``"free"`` = the device's free memory)."""

    index: int
    ceiling_room: int
    free_room: int
    per_token_bytes: int
    bytes: int

    @property
    def room(self) -> int:
        return max(0, min(self.ceiling_room, self.free_room))

    @property
    def bound_by(self) -> str:
        return "share" if self.ceiling_room <= self.free_room else "free"


@dataclass(frozen=True)
class KvBudget:
    """A worker's KV budget: ``tokens`` across all its GPUs, ``gpus[i].bytes`` to allocate on each."""

    tokens: int
    gpus: tuple[GpuKv, ...]

    @property
    def bytes(self) -> int:
        """KV bytes over all GPUs (what the worker allocates in total)."""
        return sum(g.bytes for g in self.gpus)

    @property
    def tightest(self) -> GpuKv | None:
        """The GPU that bounds ``tokens`` (its room holds the fewest tokens)."""
        return min(
            self.gpus, key=lambda g: g.room // g.per_token_bytes if g.per_token_bytes else math.inf, default=None
        )

    def describe(self) -> str:
        """One log line: tokens, GiB per GPU and what bounds them."""
        parts = ", ".join(f"cuda:{g.index} {g.bytes / GiB:.2f} GiB (bound by {g.bound_by})" for g in self.gpus)
        return f"{self.tokens} tokens; {parts}"


def kv_budget(
    gpus: Sequence[GpuFacts],
    kv_bytes_per_token: int,
    utilization: float,
    share: float = 1.0,
    allowance_bytes: int = GPU_ALLOWANCE_BYTES,
    block_tokens: int = 1,
) -> KvBudget:
    """The KV budget of one worker on ``gpus`` (its GPUs, in ``cuda:N`` order); see the module doc.

    ``kv_bytes_per_token`` is the whole model's (all layers: 2 × layers × kv_heads × head_dim ×
    element bytes); ``utilization`` is ``workers.gpu_memory_utilization``; ``share`` this worker's
    fraction of each GPU (``1 / workers_per_gpu``); ``tokens`` is rounded down to a multiple of
    ``block_tokens`` (the KV block size). Never negative; 0 when nothing fits.
    """
    if kv_bytes_per_token <= 0 or block_tokens <= 0:
        raise ValueError("kv_bytes_per_token and block_tokens must be positive")
    rooms = []
    for i, g in enumerate(gpus):
        ceiling = int(g.total_bytes * utilization * share) - g.weights_bytes - g.activation_peak_bytes - allowance_bytes
        free = g.free_bytes - reserve(g.total_bytes, utilization) - g.activation_peak_bytes
        if not g.resident:
            free -= g.weights_bytes + allowance_bytes
        per_token = math.ceil(kv_bytes_per_token * g.layer_fraction) if g.layer_fraction > 0 else 0
        rooms.append((i, ceiling, free, per_token))
    fits = [max(0, min(c, f)) // p for _, c, f, p in rooms if p > 0]
    tokens = min(fits, default=0) // block_tokens * block_tokens
    return KvBudget(tokens, tuple(GpuKv(i, c, f, p, tokens * p) for i, c, f, p in rooms))


def reserve(total_bytes: int, utilization: float) -> int:
    """Bytes of a GPU kept out of every worker's reach: ``total × (1 − utilization)``."""
    return total_bytes - int(total_bytes * utilization)


def memory_fraction(utilization: float, share: float = 1.0) -> float:
    """The fraction for ``torch.cuda.set_per_process_memory_fraction`` on each of a worker's GPUs:
    ``utilization × share`` (at most 1), so one replica's transient allocations raise an
    ``OutOfMemoryError`` in its own process instead of spilling into a co-tenant's share."""
    return min(1.0, utilization * share)


def too_small(budget: KvBudget, max_model_len: int, utilization: float, share: float = 1.0) -> str | None:
    """``None`` when ``budget`` holds at least one ``max_model_len`` sequence; else the message a
    worker fails its start with (instead of reporting Ready and answering every request 400)."""
    if budget.tokens >= max_model_len:
        return None
    g = budget.tightest
    where = ""
    if g is not None:
        where = (
            f" (cuda:{g.index} has {g.room / GiB:.2f} GiB for KV, bound by "
            + (
                "this worker's share: total × gpu_memory_utilization × share − weights − activations − allowance"
                if g.bound_by == "share"
                else "the GPU's free memory: other processes hold the rest"
            )
            + ")"
        )
    fixes = ["lower model.max_model_len", "raise workers.gpu_memory_utilization"]
    if share < 1:
        fixes.append("lower workers.workers_per_gpu")
    if g is not None and g.bound_by == "free":
        fixes.insert(0, "free the GPU (nvidia-smi shows who holds it)")
    return (
        f"KV budget of {budget.tokens} tokens is less than one max_model_len={max_model_len} sequence{where} "
        f"at gpu_memory_utilization={utilization}"
        + (f", share {share:g}" if share < 1 else "")
        + "; "
        + ", or ".join(fixes)
    )
