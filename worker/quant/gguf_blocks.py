"""GGUF quantized blocks unpacked natively into the per-group arrays of
:class:`worker.quant.format.QuantizedWeight` (numpy only: no torch, no float copy of the weight).

A GGUF tensor of logical shape [N rows, K columns] is stored row by row, each row a run of blocks
along K. Layouts (ggml-common.h; the formulas are ``gguf.quants``' own ``dequantize_blocks``):

- ``Q8_0``: 32 values, fp16 ``d`` then 32 int8 ``q``: ``w = d·q`` → 8 bits, group 32, scale ``d``.
- ``Q4_0``: 32 values, fp16 ``d`` then 16 bytes: ``w = d·(q − 8)`` → 4 bits, group 32, scale ``d``,
  offset ``−8·d``.
- ``Q4_1``: 32 values, fp16 ``d``, fp16 ``m``, 16 bytes: ``w = d·q + m`` → scale ``d``, offset ``m``.
  In both 4-bit block types byte ``j`` holds value ``j`` in its low nibble and ``j + 16`` in its high.
- ``Q4_K``: super-blocks of 256 values: fp16 ``d``, fp16 ``dmin``, 12 bytes of 6-bit sub-scales
  ``sc`` and sub-mins ``m`` (8 each), 128 bytes: ``w = d·sc·q − dmin·m`` per sub-block of 32 →
  group 32, scale ``d·sc``, offset ``−dmin·m``. Its 32-byte chunk ``c`` holds sub-block ``2c`` in the
  low nibbles and ``2c + 1`` in the high ones.

Every other quantized type (Q5_*, Q6_K, Q2_K, Q3_K, IQ*, ...) is refused by name
(:func:`unsupported`); F32/F16/BF16 tensors are float and load as such.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import Q4_K

from worker.contract.gguf_header import read_tensor_types

# type -> (bits, bytes per block, values per block)
NATIVE = {T.Q8_0: (8, 34, 32), T.Q4_0: (4, 18, 32), T.Q4_1: (4, 20, 32), T.Q4_K: (4, 144, 256)}
FLOAT = {T.F32, T.F16, T.BF16}
GROUP = 32  # the group size every native type maps to
FIX = "set model.quantization: none to serve it dequantized to float, or convert the file to Q8_0, Q4_0, Q4_1 or Q4_K"


class UnsupportedGGUF(ValueError):
    """A GGUF file holds a tensor type this engine cannot serve as stored; the message names it."""


def unpack(qtype: T, raw: np.ndarray, n: int, k: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray | None]:
    """``(bits, q, scale, offset)`` of one GGUF tensor [n, k] from its raw block bytes ``raw`` (uint8,
    ``n · k / values_per_block · bytes_per_block`` of them, any shape). ``q`` [n, k] is int8 (8 bits) or
    uint8 in [0, 15] (4 bits); ``scale`` and ``offset`` [n, k / 32] float32 (``offset`` None for Q8_0).
    Raises :class:`UnsupportedGGUF` for a type outside :data:`NATIVE`."""
    if qtype not in NATIVE:
        raise UnsupportedGGUF(f"GGUF tensor type {qtype.name} cannot be served as stored; {FIX}")
    _, size, per = NATIVE[qtype]
    if k % per:
        raise UnsupportedGGUF(f"GGUF {qtype.name} row of {k} values is not whole blocks of {per}")
    blocks = np.asarray(raw, dtype=np.uint8).reshape(n, k // per, size)
    d = _f16(blocks[..., 0:2])  # [n, blocks]
    if qtype == T.Q8_0:
        return 8, blocks[..., 2:].reshape(n, k).view(np.int8).copy(), d, None
    if qtype == T.Q4_0:
        return 4, _nibbles(blocks[..., 2:], n, k), d, -8.0 * d
    if qtype == T.Q4_1:
        return 4, _nibbles(blocks[..., 4:], n, k), d, _f16(blocks[..., 2:4])
    dmin = _f16(blocks[..., 2:4])
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(-1, 12))  # [n·blocks, 8] each
    scale = (d[..., None] * sc.reshape(n, -1, 8).astype(np.float32)).reshape(n, -1)
    offset = -(dmin[..., None] * m.reshape(n, -1, 8).astype(np.float32)).reshape(n, -1)
    qs = blocks[..., 16:].reshape(n, -1, 4, 1, 32)  # [n, super-blocks, chunk, -, byte]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=3)  # [n, S, 4 chunks, low/high = sub-block 2c/2c+1, 32]
    return 4, q.reshape(n, k), scale, offset


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian fp16 from the last axis's 2 bytes, as float32 (the axis dropped)."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray, n: int, k: int) -> np.ndarray:
    """32-value blocks of 16 bytes each → [n, k] uint8: low nibbles are values 0 to 15, high ones 16 to 31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)


class Reader(GGUFReader):
    """``gguf``'s reader over a plain ndarray view of its memory map: the same file mapping, but its
    header walk (one small slice per metadata value: ~100k for a 49k-token vocabulary) skips numpy
    memmap's per-slice bookkeeping, which dominates a walk of that many slices."""

    @property
    def data(self) -> np.ndarray:
        return self._mapped

    @data.setter
    def data(self, mapped: np.ndarray) -> None:
        self._mapped = mapped.view(np.ndarray)


def unsupported(path: Path | str) -> list[str]:
    """Names of the tensor types in the GGUF file at ``path`` that are neither served natively nor
    float, each once, sorted (empty: the file can be served as stored). Reads the header only."""
    types = {T[name] for name in read_tensor_types(path).values()}
    return sorted(t.name for t in types - set(NATIVE) - FLOAT)


def check_servable(path: Path | str) -> None:
    """Raise :class:`UnsupportedGGUF` with one line naming the file's unservable types and what to do."""
    if bad := unsupported(path):
        raise UnsupportedGGUF(
            f"{Path(path).name} holds GGUF tensor type{'s' if len(bad) > 1 else ''} {', '.join(bad)}, "
            f"which model.quantization: auto cannot serve as stored (served: Q8_0, Q4_0, Q4_1, Q4_K); {FIX}"
        )
