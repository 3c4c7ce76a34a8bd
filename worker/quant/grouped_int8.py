"""Kernel candidates for int8 weights computed as a float32 sum of per-group
``_weight_int8pack_mm`` products: a weight with a scale per group of columns (GGUF's ``Q8_0``: groups
of 32), which that op (one scale per output channel) cannot take whole, and a per-row int8 weight
cut into column chunks (:data:`SPLIT`) so that its bfloat16 products are summed in float32.

Each group's columns are one per-channel int8 matrix [N, group] with that group's scales, so the
product is a sum over the K / group groups of ``_weight_int8pack_mm`` calls: exact in the weights
(no rounding beyond the file's and, with bfloat16 activations, the scales'), reading the int8 bytes
once per call. With bfloat16 activations each product is rounded to bfloat16 on its own and the sum
is float32, so the output is not on bfloat16's grid (logits near 25 would move in steps of 0.125
and tie): a bfloat16 error per product, as llama.cpp's 8-bit activations have, and no coarse steps.
Why it exists: on a CPU without native bfloat16, torch's int8 op with float32 activations (the only
other way to keep float32 logits) is several times slower, which made the LM head most of a
quantized decode step (the docs' benchmark results have the figures).

The weight is re-laid out once at build, [K / group, N, group] (the same bytes in another order).
The kernel's ``gather`` reads embedding rows from that layout, so a tied embedding table and LM head
hold it once.
"""

from __future__ import annotations

import torch

from worker.quant.format import QuantizedWeight

SPLIT = 64  # column chunk of a per-row int8 weight: 9 bfloat16 products for K = 576


def accepts(w, dt: torch.dtype, device: torch.device) -> bool:
    """An int8 weight cut into more than one group per row, on a CPU."""
    return isinstance(w, QuantizedWeight) and w.bits == 8 and w.group_size < w.shape[1] and device.type == "cpu"


def accepts_split(w, dt: torch.dtype, device: torch.device) -> bool:
    """A per-row int8 weight on a CPU whose K holds more than one :data:`SPLIT` chunk."""
    if not isinstance(w, QuantizedWeight) or w.bits != 8 or device.type != "cpu":
        return False
    k = w.shape[1]
    return w.group_size == k and k > SPLIT and k % SPLIT == 0


def regroup(w: QuantizedWeight, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` as [K / group, N, group] (contiguous) and the float32 scale of each group [K / group, N]
    (a per-row scale repeated when ``group`` cuts a per-row weight)."""
    n, k = w.shape
    groups = k // group
    q = w.q.view(n, groups, group).transpose(0, 1).contiguous()
    scale = w.scale if w.scale.shape[1] == groups else w.scale.expand(n, groups)
    return q, scale.t()


def builder(act: torch.dtype, kernel_type, split: int | None = None):
    """``build(w, dt) -> kernel_type(name, fn, held, gather)`` (:class:`worker.quant.kernels.Kernel`)
    computing the group products with ``act`` activations and summing them in float32; ``fn`` returns
    the caller's dtype. ``split``: the column chunk of a per-row weight (else its own groups)."""

    def build(w: QuantizedWeight, dt: torch.dtype):
        g = split or w.group_size
        q, scale32 = regroup(w, g)  # [groups, N, g], [groups, N]
        groups = q.shape[0]
        scale = scale32.to(act).contiguous()
        op = torch.ops.aten._weight_int8pack_mm

        def fn(x: torch.Tensor) -> torch.Tensor:
            xs = x.to(act).view(x.shape[0], groups, g)
            out = op(xs[:, 0].contiguous(), q[0], scale[0]).float()
            for i in range(1, groups):
                out += op(xs[:, i].contiguous(), q[i], scale[i])
            return out.to(x.dtype)

        kind = "int8split" if split else "int8group"
        return kernel_type(
            f"{kind}-{str(act).removeprefix('torch.')}", fn, (q, scale, w.scale), gather_from(q, w.scale)
        )

    return build


def gather_from(q: torch.Tensor, scale: torch.Tensor):
    """``ids [T] -> [T, K]`` float32 rows of a weight laid out as ``q`` [groups, N, g] with its own
    float32 ``scale`` [N, groups or 1] (the file's, not the kernel's bfloat16 copy)."""
    groups, _, g = q.shape

    def gather(ids: torch.Tensor) -> torch.Tensor:
        rows = q.index_select(1, ids).transpose(0, 1).float()  # [T, groups, g]
        return (rows * scale[ids].unsqueeze(-1)).reshape(ids.shape[0], groups * g)

    return gather
