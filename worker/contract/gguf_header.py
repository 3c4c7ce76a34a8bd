"""A GGUF file's tensor table (name → GGML type) read from its header alone, in milliseconds.

``gguf.GGUFReader`` builds every metadata value first (seconds for a large vocabulary; the figure
is in the docs' benchmark results); planning needs only the tensors' types, so this walks the
header and skips the metadata values by their sizes. The layout is GGUF v2/v3's (ggml's ``docs/gguf.md``), little
endian: magic ``GGUF``, version u32, tensor count u64, metadata count u64; each metadata entry a
string key, a value type u32 and the value; then per tensor a string name, a dimension count u32,
the dimensions u64 each, the type u32 and the data offset u64. Strings are a u64 length and bytes.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

# metadata value types (gguf.GGUFValueType) → bytes of one value; 8 = string, 9 = array
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


def tensor_types(path: Path | str) -> dict[str, str]:
    """``{"blk.0.attn_q.weight": "Q4_1", ...}``: each tensor's GGML type name
    (``gguf.GGMLQuantizationType``) in the GGUF file at ``path``.

    Raises ``ValueError`` for a file that is not a little-endian GGUF v2/v3 (the caller may then
    use ``gguf.GGUFReader``, which reads the rest), ``OSError`` when it cannot be read.
    """
    from gguf import GGMLQuantizationType

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        try:
            magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", m, 0)
            if magic != b"GGUF" or version not in (2, 3):
                raise ValueError(f"{path}: not a little-endian GGUF v2/v3 file")
            off = 24
            for _ in range(n_kv):
                off = _skip_string(m, off)
                (value_type,) = struct.unpack_from("<I", m, off)
                off = _skip_value(m, off + 4, value_type)
            types = {}
            for _ in range(n_tensors):
                (length,) = struct.unpack_from("<Q", m, off)
                name = m[off + 8 : off + 8 + length].decode()
                (dims,) = struct.unpack_from("<I", m, off + 8 + length)
                off += 8 + length + 4 + 8 * dims
                (ggml_type,) = struct.unpack_from("<I", m, off)
                types[name] = GGMLQuantizationType(ggml_type).name
                off += 4 + 8  # the type and the data offset
        except struct.error as exc:  # a count or length runs past the end: not what it claims to be
            raise ValueError(f"{path}: truncated GGUF header ({exc})") from None
    return types


def read_tensor_types(path: Path | str) -> dict[str, str]:
    """:func:`tensor_types`, or ``gguf.GGUFReader``'s tensor table for a layout the header walk
    does not take (big-endian, GGUF v1): the one way the project reads a GGUF file's types.
    Raises ``ValueError`` when neither reads it, ``OSError`` when it cannot be read."""
    try:
        return tensor_types(path)
    except ValueError:
        from gguf import GGUFReader

        return {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}


def _skip_string(m: mmap.mmap, off: int) -> int:
    (length,) = struct.unpack_from("<Q", m, off)
    return off + 8 + length


def _skip_value(m: mmap.mmap, off: int, value_type: int) -> int:
    if value_type in _SCALAR:
        return off + _SCALAR[value_type]
    if value_type == _STRING:
        return _skip_string(m, off)
    if value_type != _ARRAY:
        raise ValueError(f"unknown GGUF metadata value type {value_type}")
    item_type, count = struct.unpack_from("<IQ", m, off)
    off += 12
    if item_type in _SCALAR:
        return off + count * _SCALAR[item_type]
    for _ in range(count):  # strings (a vocabulary) or nested arrays: each has its own length
        off = _skip_value(m, off, item_type)
    return off
