"""A kernel candidate for a 4-bit weight whose products must leave bfloat16's grid: an LM head
served from a GGUF ``Q4_0``/``Q4_1``/``Q4_K`` table (or any 4-bit weight in groups torch's CPU int4
op takes) in a float32 model.

torch's ``_weight_int4pack_mm_for_cpu`` with float32 activations is slow on a CPU without native
bfloat16, and with bfloat16 ones its output is rounded to bfloat16, whose steps near a logit of 25
are 0.125. Here the weight is cut along K into chunks of :data:`~worker.quant.grouped_int8.SPLIT`
columns (whole groups), each packed on its own; a call is one bfloat16 product per chunk summed in
float32: a bfloat16 error per product, no coarse steps, the same bytes as one pack (the docs'
benchmark results have the timings of the three).
"""

from __future__ import annotations

import torch

from worker.quant.format import QuantizedWeight
from worker.quant.grouped_int8 import SPLIT

GROUPS = (32, 64)  # group sizes _weight_int4pack_mm_for_cpu takes that fit a SPLIT-column chunk


def accepts(w, dt: torch.dtype, device: torch.device) -> bool:
    """A 4-bit weight on a CPU in groups that tile :data:`SPLIT`-column chunks, more than one chunk."""
    if not isinstance(w, QuantizedWeight) or w.bits != 4 or device.type != "cpu":
        return False
    k = w.shape[1]
    return w.group_size in GROUPS and k > SPLIT and k % SPLIT == 0


def builder(kernel_type, scales_and_zeros):
    """``build(w, dt) -> kernel_type(name, fn, held)`` (:class:`worker.quant.kernels.Kernel`);
    ``scales_and_zeros(w, dtype)`` is torch's [K / group, N, 2] form of ``w``'s scales and offsets."""

    def build(w: QuantizedWeight, dt: torch.dtype):
        k, g = w.shape[1], w.group_size
        chunks, per = k // SPLIT, SPLIT // g
        packs, szs = [], []
        for i in range(chunks):
            q = w.q[:, i * SPLIT : (i + 1) * SPLIT].contiguous()
            packs.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1))
            part = slice(i * per, (i + 1) * per)
            sub = QuantizedWeight(4, q, w.scale[:, part].contiguous(), w.offset[:, part].contiguous(), g, w.source)
            szs.append(scales_and_zeros(sub, torch.bfloat16))
        op = torch.ops.aten._weight_int4pack_mm_for_cpu

        def fn(x: torch.Tensor) -> torch.Tensor:
            xs = x.to(torch.bfloat16)
            out = op(xs[:, :SPLIT].contiguous(), packs[0], g, szs[0]).float()
            for i in range(1, chunks):
                out += op(xs[:, i * SPLIT : (i + 1) * SPLIT].contiguous(), packs[i], g, szs[i])
            return out.to(x.dtype)

        return kernel_type("int4split-bf16", fn, (*packs, *szs))

    return build
