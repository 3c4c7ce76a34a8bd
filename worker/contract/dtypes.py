"""Which floating-point type ``model.dtype: auto`` means on this hardware (torch-free).

One rule, used by the worker's loader and by ``llamadeploy plan``/``doctor``:

* GPU: bfloat16 on compute capability ≥ 8.0 (Ampere and later have bf16 tensor cores, and the
  fast attention kernels — FlashAttention 2, PyTorch's flash SDPA — accept bf16 only from sm80),
  float16 below (T4 = 7.5, V100 = 7.0). A layer-split replica takes its weakest GPU.
* CPU: bfloat16 when the CPU has native bf16 arithmetic (``avx512_bf16``: Cooper Lake, Sapphire
  Rapids, Zen 4+; or AMX ``amx_bf16``: Sapphire Rapids+), where oneDNN runs bf16 matmuls natively,
  reading half the bytes of float32; float32 elsewhere, where bf16 is emulated and slower than float32.

Sources: NVIDIA's CUDA compute capability table (developer.nvidia.com/cuda-gpus); the Linux
``/proc/cpuinfo`` flag names (arch/x86/include/asm/cpufeatures.h).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

BF16_MIN_CAPABILITY = (8, 0)
CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
FLOAT_DTYPES = ("float32", "bfloat16", "float16")

Capability = tuple[int, int]


def auto_dtype(capability: Capability) -> str:
    """``model.dtype: auto`` on a GPU of compute ``capability`` (major, minor): ``"bfloat16"``
    from 8.0, else ``"float16"``."""
    return "bfloat16" if tuple(capability) >= BF16_MIN_CAPABILITY else "float16"


def cpu_auto_dtype(flags: Iterable[str]) -> str:
    """``model.dtype: auto`` on a CPU with these ``/proc/cpuinfo`` flags: ``"bfloat16"`` with
    ``avx512_bf16`` or ``amx_bf16``, else ``"float32"``."""
    return "bfloat16" if CPU_BF16_FLAGS & set(flags) else "float32"


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> frozenset[str]:
    """The ``flags`` of the first processor in ``cpuinfo`` (a path, or the file's text when it
    contains a newline); empty when unreadable (not Linux, or not x86: ARM lists ``Features``)."""
    if isinstance(cpuinfo, str) and "\n" in cpuinfo:
        text = cpuinfo
    else:
        try:
            text = Path(cpuinfo).read_text()
        except OSError:
            return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def resolve(setting: str, device: str, capabilities: Sequence[Capability] = (), flags: Iterable[str] = ()) -> str:
    """The dtype name a worker loads: ``setting`` unless it is ``"auto"``.

    ``device`` is ``"cuda"`` or ``"cpu"``; ``capabilities`` are its GPUs' (major, minor), the
    weakest decides (none known: bfloat16, as on every current data-centre GPU); ``flags`` the
    CPU's. Raises ``ValueError`` for an unknown setting.
    """
    if setting != "auto":
        if setting not in FLOAT_DTYPES:
            raise ValueError(f"model.dtype: {setting!r} is not auto, {', '.join(FLOAT_DTYPES)}")
        return setting
    if device == "cuda":
        return auto_dtype(min(capabilities)) if capabilities else "bfloat16"
    return cpu_auto_dtype(flags)


def warning(dtype: str, device: str, capabilities: Sequence[Capability] = (), flags: Iterable[str] = ()) -> str:
    """Why an explicit ``dtype`` is a poor fit for this hardware, or ``""``."""
    if dtype == "bfloat16" and device == "cuda" and capabilities and min(capabilities) < BF16_MIN_CAPABILITY:
        major, minor = min(capabilities)
        return (
            f"bfloat16 on compute capability {major}.{minor} (< 8.0) has no bf16 tensor cores and the fast "
            "attention kernels refuse it; use float16 or dtype: auto"
        )
    if dtype == "bfloat16" and device == "cpu" and not CPU_BF16_FLAGS & set(flags):
        return "bfloat16 on a CPU without avx512_bf16 or AMX is emulated and slower than float32; use dtype: auto"
    if dtype == "float16" and device == "cpu" and "amx_fp16" not in set(flags):
        return "float16 on a CPU without AMX-FP16 is emulated and several times slower; use dtype: auto"
    return ""


def describe(setting: str, device: str, capabilities: Sequence[Capability] = (), flags: Iterable[str] = ()) -> str:
    """One line for logs and ``doctor``: the chosen dtype and why, e.g. ``"auto → bfloat16 (GPU
    compute capability 9.0 ≥ 8.0)"``, with :func:`warning` appended when there is one."""
    chosen = resolve(setting, device, capabilities, flags)
    if setting != "auto":
        why = "set in model.dtype"
    elif device == "cuda":
        if capabilities:
            major, minor = min(capabilities)
            why = f"GPU compute capability {major}.{minor} {'≥' if chosen == 'bfloat16' else '<'} 8.0"
        else:
            why = "GPU of unknown compute capability"
    else:
        has = sorted(CPU_BF16_FLAGS & set(flags))
        why = f"CPU has {', '.join(has)}" if has else "CPU has neither avx512_bf16 nor amx_bf16"
    line = f"{setting} → {chosen} ({why})" if setting == "auto" else f"{chosen} ({why})"
    if note := warning(chosen, device, capabilities, flags):
        line += f"; warning: {note}"
    return line
