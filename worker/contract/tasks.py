"""What a model is served for: ``generate`` (chat and completions) or ``embed`` (``/v1/embeddings``).

:func:`resolve_task` is the one rule, read by the launcher, the router and the worker alike; it
looks only at the model folder's JSON files (no torch, no transformers).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from worker.contract.settings import ModelConfig

Task = Literal["generate", "embed"]

# transformers' model_type of encoder-only families: they have no LM head to generate with
ENCODER_TYPES = frozenset(
    {"bert", "roberta", "xlm-roberta", "distilbert", "mpnet", "electra", "deberta", "deberta-v2", "modernbert"}
)


def read_json(path: Path) -> dict:
    """``path`` as a JSON object; ``{}`` when it is missing or not a JSON object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def is_sentence_transformers(model_dir: Path) -> bool:
    """The folder is in sentence-transformers layout (``modules.json`` names its modules)."""
    return (model_dir / "modules.json").is_file()


class TaskError(ValueError):
    """The model cannot be served for the task deploy.yaml names (the message says why, in one line)."""


def check_task(cfg: ModelConfig, model_dir: Path | str | None) -> None:
    """Raise :class:`TaskError` for ``task: generate`` on an encoder (:data:`ENCODER_TYPES`), which
    has no LM head: its worker would fail to load it; and for ``quantization: int8``/``int4`` on an
    embedding model, whose worker computes in the float dtype (the setting would be ignored).
    Anything not readable here passes."""
    if cfg.quantization in ("int8", "int4") and resolve_task(cfg, model_dir) == "embed":
        raise TaskError(
            f"model '{cfg.public_name}' is served for embeddings, which run with float weights: "
            f"quantization: {cfg.quantization} would be ignored; set model.quantization: auto (or none)"
        )
    if cfg.task != "generate" or model_dir is None or not Path(model_dir).is_dir():
        return
    kind = read_json(Path(model_dir) / "config.json").get("model_type")
    if kind in ENCODER_TYPES:
        raise TaskError(
            f"model '{cfg.public_name}' is an encoder ({kind}), which has no LM head to generate with: "
            "set model.task: embed (or auto) and call /v1/embeddings"
        )


def resolve_task(cfg: ModelConfig, model_dir: Path | str | None) -> Task:
    """``model.task``, or for ``auto``: ``embed`` for a sentence-transformers folder or an encoder
    (``config.json``'s ``model_type`` in :data:`ENCODER_TYPES`), else ``generate`` (a GGUF file, a
    Llama checkpoint, a folder not readable here)."""
    if cfg.task != "auto":
        return cfg.task
    if model_dir is None:
        return "generate"
    folder = Path(model_dir)
    if not folder.is_dir():
        return "generate"
    if is_sentence_transformers(folder):
        return "embed"
    return "embed" if read_json(folder / "config.json").get("model_type") in ENCODER_TYPES else "generate"
