"""Loading a Llama-family GGUF file's weights as stored: quantized matrices become
:class:`worker.quant.format.QuantizedWeight` (:mod:`worker.quant.gguf_blocks`), float tensors
(norms, F32/F16/BF16 matrices) float tensors, under transformers' names, so :mod:`worker.llama`
builds the model from them as from a safetensors folder.

The ``gguf`` package's reader memory-maps the file: each tensor's blocks are unpacked once into the
per-group arrays, never into a float copy of the weight.

llama.cpp's converter permutes the rows of ``attn_q`` and ``attn_k`` for its rotary layout; they are
put back in transformers' order with transformers' own rule (the one the float conversion in
:mod:`launcher.models` goes through), applied to the rows of ``q``, ``scale`` and ``offset`` alike.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from worker.contract.tp_rules import shard_range
from worker.quant import ggml_kernel
from worker.quant.format import QuantizedWeight
from worker.quant.gguf_blocks import FLOAT, GROUP, NATIVE, Reader, UnsupportedGGUF, unpack

log = logging.getLogger(__name__)

# GGUF's llama tensor names -> transformers' (``{}`` is the layer number)
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
GLOBAL_NAMES["output.weight"] = "lm_head.weight"
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

Weight = torch.Tensor | QuantizedWeight


def hf_name(name: str) -> str | None:
    """transformers' name of GGUF tensor ``name`` (``blk.3.attn_q.weight`` →
    ``model.layers.3.self_attn.q_proj.weight``), or None for one the Llama forward does not use
    (``rope_freqs``: the config carries the RoPE scaling)."""
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def load_gguf_weights(
    path: Path | str, config, device: torch.device, dtype: torch.dtype, rank: int = 0, world: int = 1
) -> dict[str, Weight]:
    """Every tensor the Llama forward uses from the GGUF file at ``path``, by transformers' name:
    quantized 2-D ones as :class:`QuantizedWeight` [N out, K in] on ``device``, float ones cast to
    ``dtype``. ``config``: the model's transformers config (head counts for the q/k row order). With
    ``world`` > 1 only rank ``rank``'s part of each split weight is kept
    (:func:`worker.tp_rules.shard_range`; column cuts must fall on group boundaries).
    Raises :class:`UnsupportedGGUF` for a tensor type that cannot be served as stored."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    weights: dict[str, Weight] = {}
    for t in Reader(path).tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
        if t.tensor_type in FLOAT:
            w = torch.from_numpy(np.array(t.data)).reshape(shape)
        elif t.tensor_type in NATIVE and len(shape) == 2:
            w = quantized(t, *shape)
        else:
            raise UnsupportedGGUF(f"{t.name}: GGUF tensor type {t.tensor_type.name} cannot be served as stored")
        if ".attn_q." in t.name or ".attn_k." in t.name:
            w = take_rows(w, rotary_rows(shape[0], heads, kv_heads if ".attn_k." in t.name else heads))
        if (where := shard_range(name, shape, rank, world)) is not None:
            w = narrow(w, *where)
        weights[name] = w.to(device=device, dtype=dtype) if isinstance(w, torch.Tensor) else to_device(w, device)
    return weights


def quantized(t, n: int, k: int) -> QuantizedWeight:
    """GGUF tensor ``t`` [n, k] of a :data:`NATIVE` type unpacked, its blocks kept beside where the ggml
    kernels are loaded. Raises :class:`UnsupportedGGUF` naming the tensor when a row is not whole blocks."""
    try:
        bits, q, scale, offset = unpack(t.tensor_type, t.data, n, k)
    except UnsupportedGGUF as exc:
        raise UnsupportedGGUF(f"{t.name}: {exc}") from None
    w = QuantizedWeight(
        bits,
        torch.from_numpy(q),
        torch.from_numpy(scale),
        None if offset is None else torch.from_numpy(offset),
        GROUP,
        t.tensor_type.name,
    )
    if int(t.tensor_type) in ggml_kernel.TYPES and ggml_kernel.load():
        w.blocks = torch.from_numpy(np.array(t.data, dtype=np.uint8).reshape(n, -1))
        w.ggml_type = int(t.tensor_type)
    return w


def rotary_rows(rows: int, heads: int, kv_heads: int) -> torch.Tensor:
    """The row order [rows] that undoes llama.cpp's rotary permutation of a q (``kv_heads == heads``)
    or k projection: transformers' ``LlamaTensorProcessor`` applied to the row numbers."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    processor = LlamaTensorProcessor(config={"num_attention_heads": heads, "num_key_value_heads": kv_heads})
    name = "blk.0.attn_k.weight" if kv_heads != heads else "blk.0.attn_q.weight"
    return torch.from_numpy(np.ascontiguousarray(processor.process(np.arange(rows), name).weights))


def take_rows(w: Weight, rows: torch.Tensor) -> Weight:
    """``w`` with its rows (output channels) in the order ``rows``."""
    if isinstance(w, torch.Tensor):
        return w.index_select(0, rows)
    offset = None if w.offset is None else w.offset.index_select(0, rows)
    blocks = None if w.blocks is None else w.blocks.index_select(0, rows)
    return QuantizedWeight(
        w.bits,
        w.q.index_select(0, rows),
        w.scale.index_select(0, rows),
        offset,
        w.group_size,
        w.source,
        blocks,
        w.ggml_type,
    )


def narrow(w: Weight, dim: int, start: int, stop: int) -> Weight:
    """Rows (``dim`` 0) or columns (``dim`` 1) ``[start, stop)`` of ``w``. A quantized weight's column
    cut must fall on its group boundaries (raises ``ValueError`` otherwise)."""
    if isinstance(w, torch.Tensor):
        return w.narrow(dim, start, stop - start).contiguous()
    g = w.group_size
    if dim == 1 and (start % g or stop % g):
        raise ValueError(f"a {w.source} weight's columns cut at {start}:{stop} splits its groups of {g}")
    gs, ge = (start, stop) if dim == 0 else (start // g, stop // g)

    def cut(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
        return t.narrow(dim, a, b - a).contiguous()

    offset = None if w.offset is None else cut(w.offset, gs, ge)
    blocks = None if w.blocks is None or dim == 1 else cut(w.blocks, start, stop)  # a column cut: no blocks
    return QuantizedWeight(
        w.bits, cut(w.q, start, stop), cut(w.scale, gs, ge), offset, g, w.source, blocks, w.ggml_type
    )


def to_device(w: QuantizedWeight, device: torch.device) -> QuantizedWeight:
    """``w`` with its tensors on ``device`` (a no-op on the CPU)."""
    if w.q.device == device:
        return w
    offset = None if w.offset is None else w.offset.to(device)
    return QuantizedWeight(w.bits, w.q.to(device), w.scale.to(device), offset, w.group_size, w.source)


def fused_linear(make, parts: list[Weight]):
    """One callable ``x [T, K] -> [T, ΣNi]`` for the projections ``parts`` [Ni, K] (the fused q/k/v and
    gate/up): ``make`` of their rows stacked where they are stored alike (all float, or quantized with
    the same bits and group size), else each part's own ``make`` and the outputs joined (a GGUF
    file may store a layer's q, k and v in different types)."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return make(torch.cat(parts))
    kinds = {(p.bits, p.group_size) if isinstance(p, QuantizedWeight) else None for p in parts}
    if len(kinds) > 1:
        each = [make(p) for p in parts]
        return lambda x: torch.cat([f(x) for f in each], dim=-1)
    offset = None if parts[0].offset is None else torch.cat([p.offset for p in parts])
    same_blocks = all(p.blocks is not None for p in parts) and len({p.ggml_type for p in parts}) == 1
    return make(
        QuantizedWeight(
            parts[0].bits,
            torch.cat([p.q for p in parts]),
            torch.cat([p.scale for p in parts]),
            offset,
            parts[0].group_size,
            "+".join(dict.fromkeys(p.source for p in parts)),
            torch.cat([p.blocks for p in parts]) if same_blocks else None,
            parts[0].ggml_type if same_blocks else None,
        )
    )
