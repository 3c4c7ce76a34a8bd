"""Where a model built from float and quantized weights alike (:mod:`worker.llama`) gets its
callables: a :class:`~worker.quant.format.QuantizedWeight` goes to :func:`quantized_linear`, a float
tensor to the float kernel the engine chose; the embedding looks rows up in either.

:func:`quantized_linear` is the one place the quantized matmul kernel is chosen; the kernel here
(dequantize the weight for each call, then ``F.linear``) is the correct but slow reference until the
measured kernel choice replaces it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from worker.quant.format import QuantizedWeight

Linear = Callable[[torch.Tensor], torch.Tensor]


def quantized_linear(qw: QuantizedWeight) -> Linear:
    """``x [T, K] -> x @ W.T`` [T, N] in ``x``'s dtype for the quantized ``W`` [N, K]."""
    return lambda x: F.linear(x, qw.dequantize(x.dtype))


def linear_for(make: Callable[[torch.Tensor], Linear]) -> Callable[[torch.Tensor | QuantizedWeight], Linear]:
    """``make`` for float weights, :func:`quantized_linear` for quantized ones."""
    return lambda w: quantized_linear(w) if isinstance(w, QuantizedWeight) else make(w)


def embedding(weight: torch.Tensor | QuantizedWeight) -> Linear:
    """``ids [T] (long) -> rows [T, hidden]`` float32 of the embedding ``weight`` [V, hidden]; a
    quantized one dequantizes only the rows looked up (llama.cpp's ``get_rows``), so the table stays
    stored once, quantized, also when the LM head is tied to it."""
    if isinstance(weight, torch.Tensor):
        return lambda ids: F.embedding(ids, weight).float()

    def rows(ids: torch.Tensor) -> torch.Tensor:
        offset = None if weight.offset is None else weight.offset[ids]
        picked = QuantizedWeight(weight.bits, weight.q[ids], weight.scale[ids], offset, weight.group_size, weight.source)
        return picked.dequantize(torch.float32)

    return rows
