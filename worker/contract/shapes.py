"""A model's shape (layers, widths, heads, vocabulary) read from its config alone, never its weights,
and the arithmetic on it: parameters, KV bytes per token, and the weights' bytes as held
(:func:`weight_bytes`, with the linear layers quantized or not: :func:`weight_format`).

Sources: a Hugging Face ``config.json`` or a GGUF file's metadata (``gguf.GGUFReader`` maps the
file and reads the header; tensor data is not touched). :func:`launcher.plan.shape.read_shape` finds
the config of a ``model.name``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker.contract.embed_spec import EmbedSpec


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
    gguf_types: GgufTypes | None = None  # a GGUF file's tensor types; None for a float checkpoint
    embed: EmbedSpec | None = None  # served for embeddings (no KV cache, no LM head); None: generate

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


# ---- the weights' bytes as held: the one planning rule of plan, up's preflight, the placement and
# the KV budget's estimate (the worker measures its own after loading; see weight_bytes) ----------

FLOAT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
QUANT_BITS = {"int8": 8, "int4": 4}
INT4_GROUP = 32  # int4 at load: values per scale and offset along K (int8 at load: one scale per row)
GGUF_GROUP = 32  # GGUF's blocks (Q4_K's 256-value super-blocks are held as 8 groups of 32)
GGUF_BITS = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q4_K": 4}  # served as stored
GGUF_FLOAT = frozenset({"F32", "F16", "BF16"})


@dataclass(frozen=True)
class GgufTypes:
    """A GGUF file's tensor types: its decoder ``linear`` weights' (``"Q4_1"``, ``"Q4_K+Q6_K"`` when
    mixed), its ``embedding`` table's (``token_embd``) and its LM head's (``output``; ``None`` when
    tied to the embeddings)."""

    linear: str
    embedding: str
    head: str | None = None


@dataclass(frozen=True)
class Held:
    """How one matrix is held: ``bits`` 8 or 4 with one float32 scale (and at 4 bits one float32
    offset) per ``group`` values along K (0: per row, one scale per output channel), or ``bits`` 0:
    in the compute dtype."""

    bits: int = 0
    group: int = 0

    def describe(self) -> str:
        if not self.bits:
            return "the compute dtype"
        extra = "a float32 scale and offset" if self.bits == 4 else "a float32 scale"
        return f"{self.bits} bits + {extra} per " + (f"{self.group} values" if self.group else "output channel")


FLOAT = Held()
INT8_ROWS = Held(8, 0)  # int8 at load: the linears, and the embedding table and LM head, per row


@dataclass(frozen=True)
class WeightFormat:
    """How the weights are held: the decoder's ``linear`` layers, the ``embedding`` table and the
    LM ``head`` (:class:`Held`); norms are always in the compute dtype. ``name`` names it ("int8",
    "int4", a GGUF file's linear type as stored "Q4_1", or for none the GGUF types dequantized, or
    ""); ``problem`` is set when ``model.quantization: auto`` cannot serve a stored type (that
    tensor is then counted dequantized)."""

    linear: Held = FLOAT
    embedding: Held = FLOAT
    head: Held = FLOAT
    name: str = ""
    problem: str = ""

    @property
    def quantized(self) -> bool:
        return bool(self.linear.bits)

    @property
    def label(self) -> str:
        """The linear layers' format in a word: ``"int8"``, ``"Q4_1"``, or ``""`` unquantized."""
        return self.name if self.quantized else ""

    def describe(self, tied: bool = False) -> str:
        """``"int8 at load: linear layers 8 bits + a float32 scale per output channel; embeddings …"``,
        ``"Q4_1 as stored: …"``, ``"none"`` or ``"none (Q4_1 dequantized)"``; ``tied``: the LM head
        is the embedding table."""
        if not self.quantized:
            return f"none ({self.name} dequantized)" if self.name else "none"
        origin = "at load" if self.name in QUANT_BITS else "as stored"
        tables = (
            f"embeddings and LM head (tied) {self.embedding.describe()}"
            if tied
            else f"embeddings {self.embedding.describe()}; LM head {self.head.describe()}"
        )
        return f"{self.name} {origin}: linear layers {self.linear.describe()}; {tables}; norms the compute dtype"


UNQUANTIZED = WeightFormat()


def _stored(gguf_type: str | None) -> Held:
    bits = GGUF_BITS.get(gguf_type or "")
    return Held(bits, GGUF_GROUP) if bits else FLOAT


def weight_format(setting: str, stored: GgufTypes | None) -> WeightFormat:
    """What ``model.quantization: setting`` holds for a model stored as ``stored`` (a GGUF file's
    types, :attr:`ModelShape.gguf_types`; ``None`` for a float checkpoint), as the worker loads it.

    ``int8``/``int4`` quantize the float weights at load (a GGUF file dequantized first): the linear
    layers by :func:`group_size`, the embedding table and LM head to int8 per row (one copy when
    tied). ``none`` holds everything in the compute dtype. ``auto`` serves a GGUF file's ``Q8_0``
    (8 bits) and ``Q4_0``/``Q4_1``/``Q4_K`` (4 bits) tensors as stored, in groups of 32, its float
    tensors in the compute dtype, and a float checkpoint unquantized; other GGUF types under
    ``auto`` come back with ``problem`` set.
    """
    if setting in QUANT_BITS:
        return WeightFormat(
            Held(QUANT_BITS[setting], 0 if setting == "int8" else INT4_GROUP), INT8_ROWS, INT8_ROWS, setting
        )
    types = [stored.linear, stored.embedding, stored.head or ""] if stored else []
    named = {t for ts in types for t in ts.split("+") if t} - GGUF_FLOAT
    if not named:
        return UNQUANTIZED
    if setting == "none":
        return WeightFormat(name="+".join(sorted(named)))
    fmt = WeightFormat(_stored(stored.linear), _stored(stored.embedding), _stored(stored.head), stored.linear)
    if unserved := sorted(named - set(GGUF_BITS)):
        return replace(
            fmt,
            problem=f"model.quantization: auto serves GGUF {', '.join(GGUF_BITS)} as stored, not "
            f"{', '.join(unserved)} (counted dequantized here); set model.quantization: none "
            "(dequantized to float) or int8 / int4",
        )
    return fmt


@dataclass(frozen=True)
class WeightBytes:
    """Bytes of a model's weights as one rank holds them: ``linear``, every decoder layer's
    attention and MLP matrices (its shard of them under tensor parallelism), and ``replicated``,
    the embeddings, the LM head unless tied, and the norms (whole on every rank)."""

    linear: int
    replicated: int

    @property
    def total(self) -> int:
        return self.linear + self.replicated


def linear_shapes(shape: ModelShape, tp: int = 1) -> tuple[tuple[int, int], ...]:
    """One decoder layer's linear weights as ``(N out, K in)`` on one of ``tp`` ranks: q, k, v, gate
    and up split along N (column-parallel), o and down along K (row-parallel), as
    :mod:`worker.contract.tp_rules` shards them."""
    h, i = shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    return ((q // tp, h), (kv // tp, h), (kv // tp, h), (h, q // tp), (i // tp, h), (i // tp, h), (h, i // tp))


def group_size(k: int, held: Held) -> int | None:
    """The values per scale of a ``K``-wide matrix held as ``held``: its group, or the whole row
    (group 0: one scale per output channel, what ``aten._weight_int8pack_mm`` takes); ``None`` where
    K holds no whole number of groups (the matrix is then counted in the compute dtype; loading
    refuses such a model)."""
    g = held.group or k
    return g if k % g == 0 else None


def matrix_bytes(n: int, k: int, element_bytes: int, held: Held) -> int:
    """Bytes of an ``[n, k]`` weight held as ``held``: ``n × k × bits / 8`` plus 4 bytes per
    group's scale (and 4 per group's offset at 4 bits) — ``worker.quant.format.QuantizedWeight.nbytes``
    — or ``n × k × element_bytes`` in the compute dtype."""
    g = group_size(k, held) if held.bits else None
    if g is None:
        return n * k * element_bytes
    return n * k * held.bits // 8 + n * (k // g) * 4 * (2 if held.bits == 4 else 1)


def weight_bytes(shape: ModelShape, dtype: str, fmt: WeightFormat = UNQUANTIZED, tp: int = 1) -> WeightBytes:
    """The weights' bytes one of ``tp`` tensor-parallel ranks holds, in ``fmt`` (:func:`weight_format`),
    the norms and whatever ``fmt`` leaves unquantized in the compute ``dtype`` (a key of
    :data:`FLOAT_BYTES`); tied embeddings count once. Unquantized on one rank the total is
    ``params × dtype bytes``.

    A planning estimate of the bytes at rest: a kernel that packs them differently, or keeps a
    second copy, shows in the weight memory the worker measures after loading, never here.
    Llama-2-7B, bfloat16: 13,476,831,232 bytes; int8: 6,744,377,344.
    """
    element, v, h = FLOAT_BYTES[dtype], shape.vocab_size, shape.hidden_size
    per_layer = sum(matrix_bytes(n, k, element, fmt.linear) for n, k in linear_shapes(shape, tp))
    tables = matrix_bytes(v, h, element, fmt.embedding)
    if not shape.tie_word_embeddings:
        tables += matrix_bytes(v, h, element, fmt.head)
    norms = h * (2 * shape.num_layers + 1) * element
    return WeightBytes(shape.num_layers * per_layer, tables + norms)


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
        gguf_types=gguf_types({t.name: t.tensor_type.name for t in reader.tensors}),
    )


GGUF_LINEAR = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def gguf_types(types: dict[str, str]) -> GgufTypes:
    """The types of a GGUF file's decoder linear weights (``blk.N.attn_q.weight`` ..., ``+``-joined
    when mixed), embeddings and LM head, from its tensor table ``types`` (name → GGML type name,
    :func:`worker.contract.gguf_header.tensor_types`)."""
    linear = {
        t
        for name, t in types.items()
        if name.startswith("blk.") and name.endswith(".weight") and name.split(".")[-2] in GGUF_LINEAR
    }
    return GgufTypes("+".join(sorted(linear)), types.get("token_embd.weight", ""), types.get("output.weight"))


def read_json_shape(path: Path, name: str = "") -> ModelShape:
    """``from_hf_config`` on the file at ``path``."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ShapeError(f"{path}: unreadable config ({exc})") from None
    return from_hf_config(data, name, str(path))
