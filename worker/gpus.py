"""The worker's view of its GPUs: what torch sees against what the launcher intended, memory.

The launcher sets ``CUDA_VISIBLE_DEVICES`` (physical indices, ``CUDA_DEVICE_ORDER=PCI_BUS_ID``)
and ``LLAMADEPLOY_EXPECTED_GPUS`` (JSON: ``share`` and the NVML ``gpus`` it meant) before this
process imports torch. A different count, UUID or name is an error naming both sides: the
classic cause is a ``CUDA_VISIBLE_DEVICES`` renumbered or overridden somewhere in between.

Also the torch side of the memory rules: the facts :func:`worker.contract.budget.kv_budget` needs, measured
after warm-up (:func:`reset_peaks`, :func:`measure_gpus`), the per-replica allocator cap
(:func:`apply_memory_fraction`, :func:`set_memory_fraction`), the heartbeat's memory figure (:func:`memory_reserved_total`)
and the GPUs' compute capabilities for ``dtype: auto``. Each takes ``cuda`` (``torch.cuda``, or a
stand-in in tests).
"""

from __future__ import annotations

import logging
import os

from worker.contract.budget import GpuFacts, KvBudget, kv_budget, memory_fraction, too_small
from worker.contract.env import expected_from_env
from worker.contract.units import GiB

log = logging.getLogger(__name__)


class GpuMismatch(RuntimeError):
    """torch sees other GPUs than the launcher placed this worker on."""


def seen_gpus() -> list[dict]:
    """What torch sees: ``[{"cuda": i, "name", "uuid" ("GPU-…" or ""), "total_bytes"}]``."""
    import torch

    if not torch.cuda.is_available():
        return []
    seen = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        uuid = str(getattr(props, "uuid", "") or "")  # torch renders it without NVML's "GPU-" prefix
        seen.append(
            {
                "cuda": i,
                "name": props.name,
                "uuid": f"GPU-{_norm_uuid(uuid)}" if uuid else "",
                "total_bytes": int(props.total_memory),
            }
        )
    return seen


def describe(gpus: list[dict]) -> str:
    """``"2 GPU(s): NVIDIA H200 139.8 GiB (GPU-1a2b…), ..."``; physical index when known."""
    parts = []
    for g in gpus:
        where = f"physical {g['index']}" if "index" in g else f"cuda:{g['cuda']}"
        parts.append(f"{where} {g['name']} {g['total_bytes'] / GiB:.1f} GiB ({g['uuid'][:12] or 'no uuid'})")
    return f"{len(gpus)} GPU(s)" + (": " + ", ".join(parts) if parts else "")


def _norm_uuid(uuid: str) -> str:
    """``GPU-1a2b…`` / ``MIG-1a2b…`` / ``1A2B…`` → ``1a2b…`` (36 characters when well formed)."""
    return uuid.strip().lower().removeprefix("gpu-").removeprefix("mig-")


def _same(expected: dict, seen: dict) -> bool:
    """Same GPU: by UUID when both sides have a well-formed one, else by name. For a MIG
    instance torch may report the instance's UUID or (older drivers) its GPU's; either matches."""
    b = _norm_uuid(seen.get("uuid") or "")
    wanted = [_norm_uuid(u) for u in (expected.get("uuid") or "", expected.get("parent_uuid") or "") if u]
    if len(b) == 36 and any(len(a) == 36 for a in wanted):
        return b in wanted
    return expected.get("name") == seen.get("name")


def check_gpus(expected: dict | None, seen: list[dict], visible: str, torch_info: str = "") -> None:
    """Raise :class:`GpuMismatch` when ``seen`` (in cuda:N order) differs from ``expected``'s GPUs
    in count, UUID (or name when a UUID is missing). ``None`` expected checks nothing."""
    if expected is None:
        return
    want = expected.get("gpus", [])
    if len(want) == len(seen) and all(_same(w, s) for w, s in zip(want, seen, strict=True)):
        return
    raise GpuMismatch(
        f"the launcher placed this worker on {describe(want)} (CUDA_VISIBLE_DEVICES={visible}) "
        f"but torch sees {describe(seen)}{torch_info}; check that nothing overrides "
        "CUDA_VISIBLE_DEVICES or CUDA_DEVICE_ORDER for workers, and `llamadeploy doctor`"
    )


def start_check(device_kind: str) -> tuple[list[dict], float]:
    """Log the GPUs this worker sees and check them. Returns ``(seen, share)``; CPU: ``([], 1.0)``."""
    if device_kind != "cuda":
        return [], 1.0
    import torch

    seen = seen_gpus()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
    log.info("sees %s (CUDA_VISIBLE_DEVICES=%s)", describe(seen), visible)
    expected = expected_from_env()
    check_gpus(expected, seen, visible, f" (torch {torch.__version__}, built for CUDA {torch.version.cuda})")
    return seen, float((expected or {}).get("share", 1.0))


def memory_report() -> str:
    """Per GPU: allocated by this process, and free/total on the device, in GiB."""
    import torch

    parts = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        parts.append(
            f"cuda:{i} {torch.cuda.memory_allocated(i) / GiB:.2f} GiB allocated, "
            f"{free / GiB:.2f} of {total / GiB:.2f} GiB free"
        )
    return "; ".join(parts)


def layer_fractions(device_map: dict | None, num_layers: int) -> dict[int, float]:
    """Share of decoder layers (hence of the KV cache) on each GPU, from ``hf_device_map``.

    ``{"model.layers.0": 0, ..., "lm_head": 1}`` → ``{0: 0.5, 1: 0.5}``; no map → ``{0: 1.0}``.
    """
    counts: dict[int, int] = {}
    for name, dev in (device_map or {}).items():
        parts = name.split(".")
        if "layers" in parts and parts[-1].isdigit() and isinstance(dev, int):
            counts[dev] = counts.get(dev, 0) + 1
        elif "layers" in parts and isinstance(dev, int) and name.endswith("layers"):
            counts[dev] = counts.get(dev, 0) + num_layers  # the whole stack on one device
    total = sum(counts.values())
    return {d: c / total for d, c in counts.items()} if total else {0: 1.0}


def kv_budget_tokens(
    per_token: int,
    share: float,
    utilization: float,
    device_map: dict | None,
    num_layers: int,
    activation_peak: dict[int, int] | None = None,
) -> int:
    """KV tokens this worker may hold across its GPUs, by :func:`worker.contract.budget.kv_budget` over
    :func:`measure_gpus` (``activation_peak`` per cuda index: 0 when not measured yet)."""
    facts = measure_gpus(layer_fractions(device_map, num_layers), activation_peak)
    return kv_budget(facts, per_token, utilization, share).tokens


class KvTooSmall(RuntimeError):
    """The KV budget holds less than one ``max_model_len`` sequence: the worker must not report
    Ready (it would answer every request 400); the message names the numbers and the fixes."""


def kv_budget_after_warmup(
    kv_bytes_per_token: int,
    fractions: dict[int, float],
    utilization: float,
    share: float,
    max_model_len: int,
    block_tokens: int = 1,
    cuda=None,
    activation_peak: dict[int, int] | None = None,
) -> KvBudget:
    """The worker's KV budget, measured: :func:`measure_gpus` then :func:`worker.contract.budget.kv_budget`.

    Call after :func:`reset_peaks` and the warm-up forward at ``max_prefill_tokens``, before
    allocating the KV cache; then allocate ``budget.gpus[i].bytes`` on ``cuda:i`` once
    (``budget.tokens`` tokens, a multiple of ``block_tokens``). ``activation_peak``: bytes per
    cuda index kept out beside the weights, in place of the allocator's peak (:func:`transient_peaks`
    plus the CUDA graphs' pool). Raises :class:`KvTooSmall`.
    """
    facts = measure_gpus(fractions, activation_peak, cuda=cuda)
    budget = kv_budget(facts, kv_bytes_per_token, utilization, share, block_tokens=block_tokens)
    log.info("KV budget: %s", budget.describe())
    if message := too_small(budget, max_model_len, utilization, share):
        raise KvTooSmall(message)
    return budget


def measure_gpus(
    fractions: dict[int, float], activation_peak: dict[int, int] | None = None, cuda=None
) -> list[GpuFacts]:
    """This worker's facts for :func:`worker.contract.budget.kv_budget`, one per GPU in ``fractions``
    (cuda index → share of the layers there, from :func:`layer_fractions`).

    Call it after loading and warm-up, before allocating the KV cache: it empties torch's cache
    so the warm-up's transient blocks count as free, then reads ``weights`` =
    ``memory_allocated`` (what stays: weights and buffers) and device-wide free memory
    (``mem_get_info``). ``activation_peak`` overrides, per cuda index, the peak read by
    :func:`transient_peaks` (valid after ``reset_peak_memory_stats()`` and a ``max_prefill_tokens``
    forward). ``cuda`` is ``torch.cuda`` (a stand-in in tests).
    """
    if cuda is None:
        import torch

        cuda = torch.cuda
    cuda.empty_cache()
    peaks = {**transient_peaks(cuda), **(activation_peak or {})}
    facts = []
    for dev, frac in sorted(fractions.items()):
        free, total = cuda.mem_get_info(dev)
        facts.append(GpuFacts(int(total), int(free), int(cuda.memory_allocated(dev)), peaks[dev], frac, resident=True))
    return facts


def transient_peaks(cuda=None) -> dict[int, int]:
    """Per visible cuda index, the allocator's peak since :func:`reset_peaks` above what it holds
    now (``max_memory_allocated − memory_allocated``): the warm-up forward's activations."""
    if cuda is None:
        import torch

        cuda = torch.cuda
    return {
        dev: max(0, int(cuda.max_memory_allocated(dev)) - int(cuda.memory_allocated(dev)))
        for dev in range(cuda.device_count())
    }


def reset_peaks(cuda=None) -> None:
    """``reset_peak_memory_stats`` on every visible GPU: call it just before the warm-up forward
    at ``max_prefill_tokens`` whose peak :func:`measure_gpus` then reads."""
    if cuda is None:
        import torch

        cuda = torch.cuda
    for dev in range(cuda.device_count()):
        cuda.reset_peak_memory_stats(dev)


def apply_memory_fraction(utilization: float, share: float, cuda=None) -> float:
    """Cap torch's allocator on every visible GPU at :func:`worker.contract.budget.memory_fraction` of it,
    so a transient peak raises ``OutOfMemoryError`` in this worker rather than eating a
    co-tenant's share. Call before loading. Returns the fraction."""
    return set_memory_fraction(memory_fraction(utilization, share), cuda)


def set_memory_fraction(fraction: float, cuda=None) -> float:
    """Cap torch's allocator on every visible GPU at ``fraction`` of it (a load plan's
    ``memory_fraction``). Call before loading. Returns the fraction."""
    if cuda is None:
        import torch

        cuda = torch.cuda
    for dev in range(cuda.device_count()):
        cuda.set_per_process_memory_fraction(fraction, dev)
    return fraction


def memory_reserved_total(cuda=None) -> int:
    """Bytes torch's allocator holds on all visible GPUs together (``memory_reserved`` summed):
    the heartbeat's ``mem_bytes`` on GPU, so a layer-split replica counts every GPU, and cached
    blocks count as the device sees them."""
    if cuda is None:
        import torch

        cuda = torch.cuda
    return sum(int(cuda.memory_reserved(dev)) for dev in range(cuda.device_count()))


def capabilities(cuda=None) -> list[tuple[int, int]]:
    """Compute capability (major, minor) of each visible GPU, for :func:`worker.contract.dtypes.resolve`."""
    if cuda is None:
        import torch

        cuda = torch.cuda
    return [tuple(cuda.get_device_capability(dev)) for dev in range(cuda.device_count())]
