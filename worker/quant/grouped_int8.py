"""A kernel candidate for int8 weights with a scale per group of columns (GGUF's ``Q8_0``: groups of
32), which torch's ``_weight_int8pack_mm`` (one scale per output channel) cannot take whole.

Each group's columns are one per-channel int8 matrix [N, group] with that group's scales, so the
product is a sum over the K / group groups of ``_weight_int8pack_mm`` calls: exact in the weights
(no rounding beyond the file's), reading the int8 bytes once per call. The weight is re-laid out
once at build, [K / group, N, group] (the same bytes in another order; the per-row form is freed
unless something else, such as a tied embedding, still holds it). On a CPU without native bf16
these calls read a 49152 x 576 Q8_0 LM head in ~40 ms where dequantizing it per call takes ~900 ms
(this project's 2-core box, one thread).
"""

from __future__ import annotations

import torch

from worker.quant.format import QuantizedWeight


def accepts(w, dt: torch.dtype, device: torch.device) -> bool:
    """An int8 weight cut into more than one group per row, on a CPU."""
    return isinstance(w, QuantizedWeight) and w.bits == 8 and w.group_size < w.shape[1] and device.type == "cpu"


def builder(act: torch.dtype, kernel_type):
    """``build(w, dt) -> kernel_type(name, fn, held)`` (:class:`worker.quant.kernels.Kernel`) computing the group products with ``act``
    activations and summing them in float32; ``fn`` returns the caller's dtype."""

    def build(w: QuantizedWeight, dt: torch.dtype):
        n, k = w.shape
        g = w.group_size
        groups = k // g
        q = w.q.view(n, groups, g).transpose(0, 1).contiguous()  # [groups, N, g]
        scale = w.scale.t().to(act).contiguous()  # [groups, N]
        op = torch.ops.aten._weight_int8pack_mm

        def fn(x: torch.Tensor) -> torch.Tensor:
            xs = x.to(act).view(x.shape[0], groups, g)
            out = op(xs[:, 0].contiguous(), q[0], scale[0]).float()
            for i in range(1, groups):
                out += op(xs[:, i].contiguous(), q[i], scale[i])
            return out.to(x.dtype)

        return kernel_type(f"int8group-{str(act).removeprefix('torch.')}", fn, (q, scale))

    return build
