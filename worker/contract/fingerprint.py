"""``system_fingerprint``: one string naming what produces a replica's tokens, as OpenAI's
responses carry it (``fp_`` and 12 hex digits).

It is the SHA-256 of the inputs that decide the tokens of a request, and of nothing else: the
model's files (:func:`files_identity`), the ``model`` section's quantization and random-init
setting, the dtype and device kind the worker resolved, its tensor-parallel world size, the kernel
table it runs (each weight shape's kernel per row bucket; not the measured times), and the engine's
version (the versions of this package, torch, transformers and xgrammar). Replicas started from one
configuration revision with one kernel table therefore report one fingerprint, and any change to
those inputs (new weights, another dtype or quantization, another kernel choice, an upgrade) gives
another. The worker computes it once loaded and reports it in its ``Ready``; the router puts it in
every chat completion, chunk and completion and in ``GET /workers``.

Torch-free (the router imports this package).
"""

from __future__ import annotations

import hashlib
import json
from importlib import metadata
from pathlib import Path

from worker.contract.protocol import KernelChoice
from worker.contract.settings import ModelConfig

ENGINE_PACKAGES = ("llamadeploy", "torch", "transformers", "xgrammar")
SAMPLED_BYTES = 64 * 1024  # read from each end of every model file (hashing whole weights takes minutes)


def engine_versions() -> dict[str, str]:
    """``{package: version}`` of the packages that produce tokens (``"-"`` when one is not installed)."""
    out = {}
    for name in ENGINE_PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "-"
    return out


def files_identity(path: str | Path) -> str:
    """SHA-256 (hex) of the model's files: each file's path under ``path``, its size and its first
    and last :data:`SAMPLED_BYTES` bytes (links followed: a GGUF folder links its ``model.gguf``).
    ``path`` may be one file. A re-trained or re-quantized checkpoint changes its sizes or its
    header and trailing tensors, which this reads; the same files copied elsewhere keep the value."""
    root = Path(path)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.relative_to(root) if f != root else f.name}\0{size}\0".encode())
        with open(f, "rb") as stream:
            h.update(stream.read(SAMPLED_BYTES))
            if size > 2 * SAMPLED_BYTES:
                stream.seek(size - SAMPLED_BYTES)
                h.update(stream.read(SAMPLED_BYTES))
    return h.hexdigest()


def kernel_choices(kernels: list[KernelChoice]) -> list:
    """The kernel table without its measured times: ``[n, k, weight, count, [[rows, kernel], ...]]``
    per weight shape, sorted (two replicas that chose the same kernels give the same list)."""
    return sorted([c.n, c.k, c.weight, c.count, [[p.rows, p.kernel] for p in c.picks]] for c in kernels)


def system_fingerprint(
    model_path: str | Path,
    model: ModelConfig,
    dtype: str,
    device_kind: str,
    world: int,
    kernels: list[KernelChoice],
) -> str:
    """``fp_`` and the first 12 hex digits of the SHA-256 of the inputs the module docstring lists.
    ``dtype``: the resolved one (``torch.bfloat16``...), ``device_kind``: ``cpu`` or ``cuda``,
    ``world``: tensor-parallel ranks of the replica. Raises ``OSError`` when the files cannot be read."""
    inputs = {
        "files": files_identity(model_path),
        "quantization": model.quantization,
        "random_init": model.random_init,
        "dtype": str(dtype),
        "device": device_kind,
        "world": world,
        "kernels": kernel_choices(kernels),
        "engine": engine_versions(),
    }
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
    return f"fp_{digest[:12]}"
