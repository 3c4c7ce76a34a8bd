"""How a model turns token states into one vector per input, read from the model's own files.

A sentence-transformers folder says it in ``modules.json`` (is there a ``Normalize`` module),
its pooling module's ``config.json`` (``1_Pooling/config.json``: mean, cls, max, lasttoken...),
``sentence_bert_config.json`` (``max_seq_length``) and ``config_sentence_transformers.json``
(``truncate_dim``: the model was trained so that its first dimensions are an embedding of their
own, Matryoshka style). A plain checkpoint is pooled by its family's convention: the last
token for a decoder (Llama), the mean for an encoder, both normalised.

Both the router (limits, ``dimensions``) and the worker (pooling) read this; torch-free.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from worker.contract.tasks import ENCODER_TYPES, read_json

Pooling = Literal["mean", "cls", "max", "lasttoken", "mean_sqrt_len_tokens"]
POOLINGS: tuple[Pooling, ...] = ("mean", "cls", "max", "lasttoken", "mean_sqrt_len_tokens")
LEGACY_KEYS = {  # sentence-transformers' older boolean keys of 1_Pooling/config.json
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_lasttoken": "lasttoken",
}


CPU_STEP_TOKENS = 4096  # tokens per step on CPU: a MiniLM step of this size takes tens of milliseconds
GPU_STEP_TOKENS = 32768


def step_tokens(max_prefill_tokens: int | str, on_gpu: bool, max_tokens: int) -> int:
    """Real tokens one embedding step computes (the batcher's budget, and the padded size of its
    largest micro-batch): ``workers.max_prefill_tokens``, ``auto`` meaning :data:`GPU_STEP_TOKENS`
    on GPU and :data:`CPU_STEP_TOKENS` on CPU; never below ``max_tokens`` (the longest input), so
    one input always fits. The worker batches with it and ``plan`` sizes its activations by it."""
    chosen = (GPU_STEP_TOKENS if on_gpu else CPU_STEP_TOKENS) if max_prefill_tokens == "auto" else max_prefill_tokens
    return max(int(chosen), max_tokens)


class EmbedSpecError(ValueError):
    """The model's files describe a pooling this server does not compute (the message names it)."""


@dataclass(frozen=True)
class EmbedSpec:
    """``pooling`` of the last hidden states over the real tokens, then L2 ``normalize``;
    ``hidden`` is the model's width, ``dim`` the width served (``truncate_dim`` when the model sets
    one); ``max_tokens`` the most tokens one input may have; ``matryoshka``: ``dimensions`` below
    ``dim`` are meaningful (truncate, then renormalise)."""

    pooling: Pooling
    normalize: bool
    hidden: int
    dim: int
    max_tokens: int
    matryoshka: bool
    encoder: bool


def read_pooling(model_dir: Path, modules: list) -> Pooling | None:
    """The pooling mode of a sentence-transformers folder's Pooling module (None: it has none)."""
    entry = next((m for m in modules if str(m.get("type", "")).endswith("Pooling")), None)
    if entry is None:
        return None
    cfg = read_json(model_dir / entry.get("path", "") / "config.json")
    mode = cfg.get("pooling_mode")
    if mode is None:
        modes = [name for key, name in LEGACY_KEYS.items() if cfg.get(key)]
        if len(modes) != 1:
            raise EmbedSpecError(f"{entry.get('path')}/config.json: one pooling mode expected, found {modes or 'none'}")
        mode = modes[0]
    if isinstance(mode, list):
        mode = mode[0] if len(mode) == 1 else mode
    if mode not in POOLINGS:
        raise EmbedSpecError(f"pooling mode {mode!r} is not served (one of {', '.join(POOLINGS)})")
    return mode


def read_spec(model_dir: Path | str, max_model_len: int | str) -> EmbedSpec:
    """The :class:`EmbedSpec` of the model in ``model_dir``; ``max_model_len`` (``model.max_model_len``)
    caps the tokens per input (``auto``: the model's own limit). Raises :class:`EmbedSpecError` for a
    pooling it cannot serve."""
    if max_model_len == "auto":  # an embedding model keeps no KV cache: nothing reduces its own length
        max_model_len = 1_048_576
    folder = Path(model_dir)
    config = read_json(folder / "config.json")
    encoder = config.get("model_type") in ENCODER_TYPES
    hidden = int(config.get("hidden_size") or config.get("d_model") or 0)
    limit = int(config.get("max_position_embeddings") or max_model_len)
    modules = _modules(folder)
    pooling = read_pooling(folder, modules) if modules else None
    normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules) if modules else True
    seq = read_json(folder / "sentence_bert_config.json").get("max_seq_length")
    truncate_dim = read_json(folder / "config_sentence_transformers.json").get("truncate_dim")
    dim = int(truncate_dim) if isinstance(truncate_dim, int) and 0 < truncate_dim < hidden else hidden
    return EmbedSpec(
        pooling=pooling or ("mean" if encoder else "lasttoken"),
        normalize=normalize,
        hidden=hidden,
        dim=dim,
        max_tokens=min(int(seq) if isinstance(seq, int) and seq > 0 else limit, limit, max_model_len),
        matryoshka=isinstance(truncate_dim, int),
        encoder=encoder,
    )


def _modules(folder: Path) -> list[dict]:
    """``modules.json`` as a list of module entries ([] when absent or malformed)."""
    try:
        data = json.loads((folder / "modules.json").read_text())
    except (OSError, ValueError):
        return []
    return [m for m in data if isinstance(m, dict)] if isinstance(data, list) else []
