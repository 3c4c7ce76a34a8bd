"""The worker's view of its GPUs: what torch sees against what the launcher intended, memory.

The launcher sets ``CUDA_VISIBLE_DEVICES`` (physical indices, ``CUDA_DEVICE_ORDER=PCI_BUS_ID``)
and ``LLAMADEPLOY_EXPECTED_GPUS`` (JSON: ``share`` and the NVML ``gpus`` it meant) before this
process imports torch. A different count, UUID or name is an error naming both sides: the
classic cause is a ``CUDA_VISIBLE_DEVICES`` renumbered or overridden somewhere in between.
"""

from __future__ import annotations

import json
import logging
import os

from launcher.placement import EXPECTED_GPUS_ENV

log = logging.getLogger(__name__)

GiB = 2**30


class GpuMismatch(RuntimeError):
    """torch sees other GPUs than the launcher placed this worker on."""


def expected_from_env(environ: dict | None = None) -> dict | None:
    """The launcher's intent ``{"share": float, "gpus": [{index, name, uuid, total_bytes}]}``, or
    ``None`` when not set (a worker started by hand)."""
    raw = (environ if environ is not None else os.environ).get(EXPECTED_GPUS_ENV, "")
    return json.loads(raw) if raw else None


def seen_gpus() -> list[dict]:
    """What torch sees: ``[{"cuda": i, "name", "uuid" ("GPU-…" or ""), "total_bytes"}]``."""
    import torch

    if not torch.cuda.is_available():
        return []
    seen = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        uuid = str(getattr(props, "uuid", "") or "")  # torch renders it without NVML's "GPU-" prefix
        seen.append({"cuda": i, "name": props.name, "uuid": f"GPU-{_norm_uuid(uuid)}" if uuid else "",
                     "total_bytes": int(props.total_memory)})
    return seen


def describe(gpus: list[dict]) -> str:
    """``"2 GPU(s): NVIDIA H200 139.8 GiB (GPU-1a2b…), ..."``; physical index when known."""
    parts = []
    for g in gpus:
        where = f"physical {g['index']}" if "index" in g else f"cuda:{g['cuda']}"
        parts.append(f"{where} {g['name']} {g['total_bytes'] / GiB:.1f} GiB ({g['uuid'][:12] or 'no uuid'})")
    return f"{len(gpus)} GPU(s)" + (": " + ", ".join(parts) if parts else "")


def _norm_uuid(uuid: str) -> str:
    """``GPU-1a2b…`` / ``1A2B…`` → ``1a2b…`` (36 characters for a whole GPU)."""
    return uuid.strip().lower().removeprefix("gpu-")


def _same(expected: dict, seen: dict) -> bool:
    """Same GPU: by UUID when both sides have a well-formed one, else by name."""
    a, b = _norm_uuid(expected.get("uuid") or ""), _norm_uuid(seen.get("uuid") or "")
    if len(a) == 36 and len(b) == 36:
        return a == b
    return expected.get("name") == seen.get("name")


def check_gpus(expected: dict | None, seen: list[dict], visible: str, torch_info: str = "") -> None:
    """Raise :class:`GpuMismatch` when ``seen`` (in cuda:N order) differs from ``expected``'s GPUs
    in count, UUID (or name when a UUID is missing). ``None`` expected checks nothing."""
    if expected is None:
        return
    want = expected.get("gpus", [])
    if len(want) == len(seen) and all(_same(w, s) for w, s in zip(want, seen, strict=True)):
        return
    raise GpuMismatch(f"the launcher placed this worker on {describe(want)} (CUDA_VISIBLE_DEVICES={visible}) "
                      f"but torch sees {describe(seen)}{torch_info}; check that nothing overrides "
                      "CUDA_VISIBLE_DEVICES or CUDA_DEVICE_ORDER for workers, and `llamadeploy doctor`")


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


def max_memory(share: float, utilization: float) -> dict[int, int]:
    """``max_memory`` for transformers' ``device_map``: ``utilization × share × total`` bytes per GPU,
    no CPU entry (no offload). Weights are then spread evenly ("auto" = balanced), leaving KV room."""
    import torch

    return {i: int(torch.cuda.get_device_properties(i).total_memory * utilization * share)
            for i in range(torch.cuda.device_count())}


def memory_report() -> str:
    """Per GPU: allocated by this process, and free/total on the device, in GiB."""
    import torch

    parts = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        parts.append(f"cuda:{i} {torch.cuda.memory_allocated(i) / GiB:.2f} GiB allocated, "
                     f"{free / GiB:.2f} of {total / GiB:.2f} GiB free")
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


def kv_budget_tokens(per_token: int, share: float, utilization: float, device_map: dict | None, num_layers: int) -> int:
    """KV tokens this worker may hold across its GPUs.

    Per GPU i: ``min(total × utilization × share − reserved by this process,
    free − total × (1 − utilization))`` bytes (the second term respects other processes). A token
    costs ``per_token × fraction of layers on i`` there; the tightest GPU bounds the total.
    """
    import torch

    tokens = []
    for dev, frac in layer_fractions(device_map, num_layers).items():
        free, total = torch.cuda.mem_get_info(dev)
        mine = int(total * utilization * share) - torch.cuda.memory_reserved(dev)
        device_wide = free - int(total * (1 - utilization))
        tokens.append(int(max(0, min(mine, device_wide)) // (per_token * frac)))
    return min(tokens)
