"""Weights as a deployment holds ggml blocks, for the ggml operator's tests."""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from worker.quant import ggml_kernel
from worker.quant.format import QuantizedWeight
from worker.quant.gguf_blocks import GROUP, unpack


def quantized(w: torch.Tensor, type_name: str) -> QuantizedWeight:
    """``w`` [N, K] float32 as ``type_name`` blocks held as a deployment's ``quantization: int8`` holds
    them (both the blocks and their unpacked values, :meth:`worker.quant.linear.Linears._ggml_blocks`)."""
    blocks = ggml_kernel.quantize(w, type_name)
    qtype = GGMLQuantizationType[type_name]
    bits, q, scale, offset = unpack(qtype, blocks.numpy(), *w.shape)
    offset = None if offset is None else torch.from_numpy(offset)
    as_t = torch.from_numpy
    return QuantizedWeight(bits, as_t(q), as_t(scale), offset, GROUP, type_name, blocks, int(qtype))
