"""A model's shape (layers, widths, heads, vocabulary) read from its config alone, never its weights.

Sources: a Hugging Face ``config.json`` or a GGUF file's metadata (``gguf.GGUFReader`` maps the
file and reads the header; tensor data is not touched). :func:`launcher.plan.shape.read_shape` finds
the config of a ``model.name``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


class ShapeError(Exception):
    """The config exists but lacks a field the memory arithmetic needs; names the field."""


@dataclass(frozen=True)
class ModelShape:
    """The numbers that size a Llama-family decoder. ``source`` says where they were read."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    max_position_embeddings: int | None = None
    source: str = ""
    architectures: tuple[str, ...] | None = None  # transformers' class names; None when the source has none

    @property
    def params(self) -> int:
        """Parameter count of a Llama decoder (no biases): embeddings, per layer q/k/v/o
        projections (k and v are ``kv_heads × head_dim`` wide under GQA), a SwiGLU MLP of three
        ``hidden × intermediate`` matrices and two RMSNorm vectors, a final norm, and the LM head
        unless tied. Llama-2-7B gives 6,738,415,616, its published count."""
        h, q_width, kv_width = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = h * q_width * 2 + h * kv_width * 2
        mlp = 3 * h * self.intermediate_size
        per_layer = attention + mlp + 2 * h
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_layers * per_layer + h


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, element_bytes: int) -> int:
    """KV-cache bytes one token costs: 2 (K and V) × layers × kv_heads × head_dim × element bytes.

    ``element_bytes`` is the cache's element size (4 for float32, 2 for bfloat16/float16); with
    GQA, ``num_kv_heads`` < attention heads shrinks it. Llama-2-70B (80 layers, 8 KV heads of 128,
    16-bit): 327,680 bytes (320 KiB) per token, 8× less than its 64 heads would need without GQA.
    The same formula as vLLM's ``get_cache_block_size`` (vllm/worker/cache_engine.py) per token.
    """
    return 2 * num_layers * num_kv_heads * head_dim * element_bytes


def _field(config, *names: str):
    """The first of ``names`` that ``config`` (a mapping or an object) sets, else ``None``."""
    for name in names:
        value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
        if value is not None:
            return value
    return None


def attention_heads(config) -> tuple[int, int]:
    """``(heads, kv_heads)`` of a Llama-family decoder ``config``: an HF config object, its
    config.json as a dict, or a :class:`ModelShape`. ``num_key_value_heads`` defaults to the heads
    (multi-head attention, no GQA), as transformers does. Raises ``ValueError`` when the config
    names no heads."""
    heads = _field(config, "num_attention_heads", "num_heads")
    if heads is None:
        raise ValueError("the model config has no num_attention_heads")
    return int(heads), int(_field(config, "num_key_value_heads", "num_kv_heads") or heads)


def attention_dims(config) -> tuple[int, int, int]:
    """``(heads, kv_heads, head_dim)``: :func:`attention_heads`, and ``head_dim`` defaulting to
    ``hidden_size // num_attention_heads`` (the one home of transformers' defaults)."""
    heads, kv_heads = attention_heads(config)
    return heads, kv_heads, int(_field(config, "head_dim") or _field(config, "hidden_size") // heads)


def from_hf_config(data: dict, name: str = "", source: str = "") -> ModelShape:
    """Build a shape from a parsed HF ``config.json`` (``text_config`` used when nested).

    Heads, KV heads and head_dim as :func:`attention_dims` reads them. Raises :class:`ShapeError`.
    """
    data = data.get("text_config") or data
    need = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    if missing := [k for k in need if not isinstance(data.get(k), int)]:
        raise ShapeError(
            f"{source or name}: config has no integer {', '.join(missing)} (plan understands Llama-style configs)"
        )
    heads, kv_heads, head_dim = attention_dims(data)
    return ModelShape(
        name=name or str(data.get("_name_or_path") or data.get("model_type") or "model"),
        hidden_size=data["hidden_size"],
        num_layers=data["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=data["intermediate_size"],
        vocab_size=data["vocab_size"],
        tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
        max_position_embeddings=data.get("max_position_embeddings"),
        source=source,
        architectures=tuple(data["architectures"]) if data.get("architectures") else None,
    )


GGUF_ARCHITECTURES = {"llama": ("LlamaForCausalLM",)}  # GGUF's llama covers Llama 2/3, Mistral, SmolLM2


def from_gguf(path: Path, name: str = "") -> ModelShape:
    """Read a shape from GGUF metadata (``<arch>.block_count``, ``.embedding_length``, ...).

    The embeddings are tied when the file has no ``output.weight`` tensor. Raises :class:`ShapeError`.
    """
    from gguf import GGUFReader

    reader = GGUFReader(path)

    def value(key: str, default=None):
        f = reader.fields.get(key)
        if f is None:
            return default
        v = f.contents()
        return max(v) if isinstance(v, list) else v  # per-layer arrays: size for the largest

    arch = value("general.architecture")
    need = {
        k: value(f"{arch}.{k}")
        for k in ("embedding_length", "block_count", "attention.head_count", "feed_forward_length")
    }
    if missing := [k for k, v in need.items() if v is None]:
        raise ShapeError(f"{path}: GGUF metadata lacks {', '.join(f'{arch}.{k}' for k in missing)}")
    heads, hidden = int(need["attention.head_count"]), int(need["embedding_length"])
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = value(f"{arch}.vocab_size") or (len(tokens.data) if tokens else None)
    if vocab is None:
        raise ShapeError(f"{path}: GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
    return ModelShape(
        name=name or str(value("general.name", path.stem)),
        hidden_size=hidden,
        num_layers=int(need["block_count"]),
        num_heads=heads,
        num_kv_heads=int(value(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(value(f"{arch}.attention.key_length", hidden // heads)),
        intermediate_size=int(need["feed_forward_length"]),
        vocab_size=int(vocab),
        tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
        max_position_embeddings=value(f"{arch}.context_length"),
        source=str(path),
        architectures=GGUF_ARCHITECTURES.get(arch, (f"gguf:{arch}",)),
    )


def read_json_shape(path: Path, name: str = "") -> ModelShape:
    """``from_hf_config`` on the file at ``path``."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ShapeError(f"{path}: unreadable config ({exc})") from None
    return from_hf_config(data, name, str(path))
