"""The one in-memory format of a weight-only quantized linear weight, shared by every source
(quantized at load, GGUF blocks) and every kernel.

A weight ``W`` [N out, K in] is cut along K into groups of ``group_size`` columns; each group of each
row has a float scale and, for 4-bit, a float offset, and (GGUF's and gpt-fast's convention)::

    W[n, k] = q[n, k] * scale[n, k // group_size] + offset[n, k // group_size]

- ``bits == 8``: ``q`` int8 in [-127, 127], ``offset`` None (symmetric, as GGUF's Q8_0).
- ``bits == 4``: ``q`` uint8 in [0, 15] (one value per byte; kernels pack it their own way),
  ``offset`` required: ``-8 * scale`` for a symmetric group (GGUF's Q4_0), the group's minimum for an
  affine one (Q4_1, Q4_K).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class QuantizedWeight:
    """A linear weight [N, K] stored per group along K (see the module docstring for the formula).

    ``q`` [N, K] (int8 for 8 bits, uint8 for 4), ``scale`` [N, K // group_size] float32,
    ``offset`` [N, K // group_size] float32 or None (8 bits only). ``source`` names where it came
    from ("int8", "int4", "Q8_0", "Q4_1" ...) for logs and ``GET /workers``. ``blocks`` [N, row_bytes]
    uint8, where the same values are also held as ggml blocks of type ``ggml_type`` (a GGUF file's
    tensor as stored, or quantized by ggml): what :mod:`worker.quant.ggml_kernel`'s kernels multiply.
    """

    bits: int
    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    group_size: int
    source: str
    blocks: torch.Tensor | None = None
    ggml_type: int | None = None

    def __post_init__(self) -> None:
        n, k = self.q.shape
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, not {self.bits}")
        if k % self.group_size:
            raise ValueError(f"K={k} is not a multiple of group_size={self.group_size}")
        if tuple(self.scale.shape) != (n, k // self.group_size):
            raise ValueError(f"scale shape {tuple(self.scale.shape)} != {(n, k // self.group_size)}")
        if self.bits == 4 and self.offset is None:
            raise ValueError("a 4-bit weight needs an offset per group")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def nbytes(self) -> int:
        """Bytes as stored at rest: ``bits`` per value plus the float32 scales and offsets."""
        n, k = self.q.shape
        groups = self.scale.numel() * (2 if self.offset is not None else 1)
        return n * k * self.bits // 8 + groups * 4

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [N, K] in ``dtype`` (the reference every kernel is tested against)."""
        n, k = self.q.shape
        g = self.group_size
        w = self.q.to(torch.float32).view(n, k // g, g) * self.scale.unsqueeze(-1)
        if self.offset is not None:
            w = w + self.offset.unsqueeze(-1)
        return w.view(n, k).to(dtype)


def quantize_int8(w: torch.Tensor, group_size: int = 32) -> QuantizedWeight:
    """Symmetric int8 per group (GGUF Q8_0's rule): ``scale = max|w| / 127``, ``q = round(w / scale)``.

    ``w`` [N, K] float with K a multiple of ``group_size``. Per-value error ≤ scale / 2.
    """
    n, k = w.shape
    g = w.detach().to(torch.float32).reshape(n, k // group_size, group_size)
    scale = g.abs().amax(-1) / 127.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(g * inv.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8).reshape(n, k)
    return QuantizedWeight(8, q, scale, None, group_size, "int8")


def quantize_int4(w: torch.Tensor, group_size: int = 32) -> QuantizedWeight:
    """Affine int4 per group (GGUF Q4_1's and gpt-fast's rule): ``scale = (max - min) / 15``,
    ``offset = min``, ``q = round((w - min) / scale)`` in [0, 15].

    ``w`` [N, K] float with K a multiple of ``group_size``. Per-value error ≤ scale / 2.
    """
    n, k = w.shape
    g = w.detach().to(torch.float32).reshape(n, k // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = (hi - lo) / 15.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round((g - lo.unsqueeze(-1)) * inv.unsqueeze(-1)).clamp_(0, 15).to(torch.uint8).reshape(n, k)
    return QuantizedWeight(4, q, scale, lo, group_size, "int4")
