"""llama.cpp's ggml CPU dot products as kernel candidates, for weights held as ggml blocks.

The operator (``worker/quant/csrc/ggml_linear.cpp``, built at set-up by :mod:`worker.quant.ggml_build`
against ggml's static libraries, compiled for the machine it installs on) is loaded here if it was
built for this machine, this torch and this source (:func:`library_path`); otherwise the worker serves
with torch's kernels and says so in one log line (:func:`load`).

``torch.ops.ggml.linear(x [T, K], blocks [N, row_bytes], type, N) -> [T, N]`` quantizes each row of
``x`` once into the weight type's ``vec_dot_type`` (Q8_0, Q8_1 or Q8_K blocks) and runs ggml's
``vec_dot`` per output value in torch's thread pool: each value depends on its own row only, so the
kernel is row-count invariant. A fake implementation is registered so ``torch.compile`` traces
around the operator.

:class:`~worker.quant.format.QuantizedWeight` carries the blocks (``blocks``, ``ggml_type``) where it
came from a GGUF file or was quantized here with ``ggml_quantize_chunk`` (:func:`quantize`); the
quantized candidates below accept only such weights. A float weight is its own blocks (ggml's F32,
F16 and BF16 rows are the tensor's bytes): :func:`float_builder` multiplies it by ggml's float
``vec_dot``, the kernel llama.cpp runs at one row for a float GGUF.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from pathlib import Path

import torch

from worker.contract import env

log = logging.getLogger(__name__)

# llama-cpp-python's source package, whose vendor/llama.cpp/ggml is built: ggml_get_type_traits_cpu is
# internal to ggml, so the version is pinned and the operator tested against it.
LLAMA_CPP_PYTHON = "0.3.36"
SOURCE = Path(__file__).resolve().parent / "csrc" / "ggml_linear.cpp"
# included by SOURCE: part of the build's key (llamafile's sgemm.cpp, which ggml_tinyblas.h includes, comes
# with the pinned ggml version, part of ggml_dir's key)
HEADERS = [SOURCE.with_name(h) for h in ("ggml_float_tiles.h", "ggml_quant_rows.h", "ggml_rows16.h", "ggml_tinyblas.h")]
NAME = "ggml_ops"
# the operator's compiler flags, part of its build key: without -fopenmp ATen's parallel_for (an inline
# template) compiles to a serial loop, and the operator would run on one thread whatever torch's count;
# -march=native: llamafile's sgemm.cpp (compiled in, ggml_tinyblas.h) picks its kernels by the compiler's
# target macros, as ggml's own build for this CPU (GGML_NATIVE) does
CFLAGS = ("-O3", "-fopenmp", "-march=native")
SWITCH = "LLAMADEPLOY_GGML_KERNELS"  # "off": torch's kernels only

# ggml_type numbers (ggml.h) -> (name, values per block, bytes per block)
TYPES = {8: ("Q8_0", 32, 34), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 12: ("Q4_K", 256, 144), 14: ("Q6_K", 256, 210)}
TYPE_OF = {name: t for t, (name, _, _) in TYPES.items()}
# float weights multiplied as they are (their rows' bytes are ggml's rows): ggml_type -> torch dtype
FLOAT_TYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}
FLOAT_TYPE_OF = {dt: t for t, dt in FLOAT_TYPES.items()}

_state: dict[str, bool] = {}


def cache_root() -> Path:
    """Where built operators live: ``$LLAMADEPLOY_CACHE/ggml`` (default ``~/.cache/llamadeploy/ggml``,
    the model cache's root), outside the source tree."""
    return env.cache_root() / "ggml"


def cpu_flags() -> str:
    """This CPU's model name and feature flags (``/proc/cpuinfo``): a build with native flags runs only
    where they hold."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [ln for ln in text.splitlines() if ln.startswith(("flags", "model name", "Features"))]
    return "\n".join(dict.fromkeys(lines))


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def ggml_dir() -> Path:
    """ggml's static libraries for this CPU: keyed by ggml's version and the CPU's flags."""
    return cache_root() / f"ggml-{LLAMA_CPP_PYTHON}-{_digest(cpu_flags())}"


def library_path() -> Path:
    """The operator's shared library (present once built): under :func:`ggml_dir`, keyed by torch's
    version, the operator's source (its headers included) and its compiler flags."""
    source = _digest(SOURCE.read_text(), *(h.read_text() for h in HEADERS), *CFLAGS)
    return ggml_dir() / f"op-torch{torch.__version__}-{source}" / f"{NAME}.so"


def load() -> bool:
    """Load the operator once; True when ``torch.ops.ggml`` is usable. Where it was not built here
    (no compiler at set-up, a failed build, another CPU) or ``LLAMADEPLOY_GGML_KERNELS=off`` (to
    compare), logs one line and returns False: the worker serves with torch's kernels."""
    if "ok" not in _state:
        if os.environ.get(SWITCH, "on") == "off":
            log.info("ggml kernels switched off (%s=off): serving with torch's kernels", SWITCH)
            _state["ok"] = False
        else:
            _state["ok"] = _load(library_path())
    return _state["ok"]


def _load(path: Path) -> bool:
    if not path.is_file():
        log.info("ggml kernels not built for this machine (%s absent): serving with torch's kernels", path)
        return False
    try:
        torch.ops.load_library(str(path))
        _register_fakes()
    except (OSError, RuntimeError) as exc:
        log.warning("ggml kernels at %s do not load (%s): serving with torch's kernels", path, exc)
        return False
    return True


def _register_fakes() -> None:
    """Shapes without computing, for ``torch.compile`` / meta tensors."""

    @torch.library.register_fake("ggml::linear")
    def _(x, blocks, type, n):
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake("ggml::linear4")
    def _(x, packed, type, n):
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake("ggml::linear16")
    def _(x, packed, type, n):
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake("ggml::gemm")
    def _(x, blocks, type, n):
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake("ggml::quantize")
    def _(w, type):
        return w.new_empty((w.shape[0], row_bytes(type, w.shape[1])), dtype=torch.uint8)

    @torch.library.register_fake("ggml::dequantize")
    def _(blocks, type, k):
        return blocks.new_empty((blocks.shape[0], k), dtype=torch.float32)


def row_bytes(ggml_type: int, k: int) -> int:
    """Bytes of one row of ``k`` values in ``ggml_type``'s blocks."""
    _, per, size = TYPES[ggml_type]
    return k // per * size


def block_values(ggml_type: int) -> int:
    """Values per block of ``ggml_type``."""
    return TYPES[ggml_type][1]


def quantize(w: torch.Tensor, type_name: str) -> torch.Tensor:
    """``w`` [N, K] float as ``type_name`` blocks [N, row_bytes] uint8 (``ggml_quantize_chunk``).
    Needs :func:`load`; K must hold whole blocks (``RuntimeError`` otherwise)."""
    return torch.ops.ggml.quantize(w.detach().to(torch.float32).contiguous(), TYPE_OF[type_name])


def dequantize(blocks: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    """Rows of blocks [R, row_bytes] as float32 [R, k] (ggml's ``to_float``)."""
    return torch.ops.ggml.dequantize(blocks, ggml_type, k)


# ---- kernel candidates (built by worker.quant.kernels, which passes its Kernel class in) -------------


def accepts(w, dt: torch.dtype, device: torch.device) -> bool:
    """A weight held as ggml blocks of a served type, on a CPU, for float32 or bfloat16 activations."""
    return (
        getattr(w, "blocks", None) is not None
        and w.ggml_type in TYPES
        and device.type == "cpu"
        and dt in (torch.float32, torch.bfloat16)
    )


def builder(kernel_class, dequantized: bool = False):
    """``build(w, dt)`` for :class:`worker.quant.kernels.Candidate`: ggml's ``vec_dot`` over the blocks
    (``ggml::linear``), or with ``dequantized`` the blocks dequantized per call (``to_float``) and
    multiplied by ``F.linear`` in ``dt`` (what a prefill-sized step may prefer: llama.cpp itself runs
    other kernels there). Both hold the blocks only, and read a tied embedding's rows from them."""

    def build(w, dt: torch.dtype):
        blocks, t, (n, k) = w.blocks.contiguous(), w.ggml_type, w.shape
        linear, dequantize = torch.ops.ggml.linear, torch.ops.ggml.dequantize
        if dequantized:
            fn = lambda x: torch.nn.functional.linear(x, dequantize(blocks, t, k).to(x.dtype))  # noqa: E731
        else:
            fn = lambda x: linear(x, blocks, t, n)  # noqa: E731
        return kernel_class("ggml", fn, (blocks,), gather=lambda ids: dequantize(blocks.index_select(0, ids), t, k))

    return build


# ggml types the ggml4 candidate offers ggml::linear4 for (pack4), Q8_0 and Q4_0. The operator computes Q4_1 too,
# but not as a candidate: on Q4_1 it is faster than int4pack-bf16 at one row only, and where a table picked it
# the int4-quantized SmolLM2 answered the README's question wrongly (8-bit activations, as llama.cpp's own
# vec_dot; int4pack's bfloat16 ones said Paris): which of two kernels of other numerics wins on a machine's load
# must not decide an answer (docs/design/engine.md).
PACKED_TYPES = (8, 2)
PACK = 4  # weight rows per group (ggml_quant_rows.h: ROWS)


def pack4(blocks: torch.Tensor, ggml_type: int, n: int) -> torch.Tensor:
    """Rows of blocks [N, row_bytes] in groups of :data:`PACK` rows, each group's blocks interleaved
    (the group's first blocks of its four rows, then their second blocks, ...), as ``ggml::linear4``
    reads them: the same bytes, [N, row_bytes]. N must be a multiple of :data:`PACK`."""
    size = TYPES[ggml_type][2]
    per_row = blocks.shape[1] // size
    return blocks.view(n // PACK, PACK, per_row, size).transpose(1, 2).contiguous().view(n, per_row * size)


def unpacked_rows(packed: torch.Tensor, ggml_type: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` [T] of a :func:`pack4` layout as plain blocks [T, row_bytes]."""
    n, rb = packed.shape
    size = TYPES[ggml_type][2]
    groups = packed.view(n // PACK, rb // size, PACK, size)
    return groups[ids // PACK, :, ids % PACK].reshape(len(ids), rb)


def packed_supported() -> bool:
    """Whether ``ggml::linear4`` runs on this build (compiled for AVX2 with FMA and F16C, ggml's x86 form
    of the dot products it reproduces). Needs :func:`load`."""
    return _runs("packed", lambda: torch.ops.ggml.linear4(torch.zeros(1, 32), _zeros(PACK), TYPE_OF["Q8_0"], PACK))


def _zeros(n: int) -> torch.Tensor:
    """Q8_0 blocks of a zero weight [n, 32]."""
    return quantize(torch.zeros(n, 32), "Q8_0")


def _runs(form: str, probe) -> bool:
    """Whether ``probe()`` runs without the operator raising (a form this build was not compiled
    for), asked once per ``form``."""
    if form not in _state:
        try:
            probe()
            _state[form] = True
        except RuntimeError:
            _state[form] = False
    return _state[form]


def accepts_packed(w, dt: torch.dtype, device: torch.device) -> bool:
    """What the ``ggml4`` candidate takes: Q8_0 or Q4_0 blocks (:data:`PACKED_TYPES`) of a whole number of
    :data:`PACK`-row groups, where this build runs ``ggml::linear4`` (:func:`packed_supported`)."""
    return accepts(w, dt, device) and w.ggml_type in PACKED_TYPES and w.shape[0] % PACK == 0 and packed_supported()


def packed_builder(kernel_class):
    """``build(w, dt)`` for :class:`worker.quant.kernels.Candidate`: ggml's ``vec_dot`` sums, bit for
    bit, four weight rows at a time over the blocks re-laid out by :func:`pack4` (``ggml::linear4``,
    ``worker/quant/csrc/ggml_quant_rows.h``). Holds the packed blocks only (a tied embedding reads its
    rows from them)."""

    def build(w, dt: torch.dtype):
        t, (n, k) = w.ggml_type, w.shape
        packed = pack4(w.blocks.contiguous(), t, n)
        linear4 = torch.ops.ggml.linear4
        gather = lambda ids: dequantize(unpacked_rows(packed, t, ids), t, k)  # noqa: E731
        return kernel_class("ggml4", lambda x: linear4(x, packed, t, n), (packed,), gather=gather)

    return build


# ggml types the ggml16 candidate offers ggml::linear16 for (pack16): Q8_0
ROWS16_TYPES = (8,)
PACK16 = 16  # weight rows per group (ggml_rows16.h: ROWS)
_SLICES = 8  # 4-quant slices of a block of 32 (ggml_rows16.h: SLICES)
_GROUP_BLOCK = 2 * PACK16 + PACK16 * 32  # a group's block: 16 fp16 scales, then 16 rows' 32 quants (GROUP_BLOCK)


def pack16(blocks: torch.Tensor, ggml_type: int, n: int) -> torch.Tensor:
    """Q8_0 rows of blocks [N, row_bytes] in groups of :data:`PACK16` rows, as ``ggml::linear16`` reads
    them (``ggml_rows16.h``): per group and block, the 16 rows' fp16 scales, then 8 slices of the 16
    rows' next 4 quants each stored as ``q + 128`` (``q XOR 0x80``); [N, row_bytes], the same size.
    N must be a multiple of :data:`PACK16`."""
    size = TYPES[ggml_type][2]
    nb = blocks.shape[1] // size
    b = blocks.view(n // PACK16, PACK16, nb, size)
    scales = b[..., :2].permute(0, 2, 1, 3).reshape(n // PACK16, nb, 2 * PACK16)
    quants = b[..., 2:].reshape(n // PACK16, PACK16, nb, _SLICES, 4).permute(0, 2, 3, 1, 4)
    quants = quants.reshape(n // PACK16, nb, PACK16 * 32) ^ 0x80
    return torch.cat([scales, quants], dim=2).reshape(n, nb * size).contiguous()


def rows16_positions(row_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a :func:`pack16` group holds each byte of its rows: ``offsets`` [16, row_bytes] (lane j's
    plain row byte b lies at the group's start + ``offsets[j, b]``) and ``flip`` [row_bytes] uint8
    (0x80 on the quants, stored as ``q + 128``; 0 on the scales)."""
    size = TYPES[TYPE_OF["Q8_0"]][2]
    nb = row_bytes // size
    block, byte = torch.arange(nb)[:, None] * _GROUP_BLOCK, torch.arange(size)[None, :]
    quant = (byte - 2).clamp_min(0)
    lanes = []
    for j in range(PACK16):
        scale_at = block + 2 * j + byte
        quant_at = block + 2 * PACK16 + quant // 4 * PACK16 * 4 + j * 4 + quant % 4
        lanes.append(torch.where(byte < 2, scale_at, quant_at).reshape(-1))
    flip = torch.where(torch.arange(size) < 2, 0, 0x80).to(torch.uint8).repeat(nb)
    return torch.stack(lanes), flip


def unpacked16_rows(
    packed: torch.Tensor, ids: torch.Tensor, positions: tuple[torch.Tensor, torch.Tensor] | None = None
) -> torch.Tensor:
    """Rows ``ids`` [T] of a :func:`pack16` layout of Q8_0 blocks as plain blocks [T, row_bytes]: one
    gather of bytes (``positions``: :func:`rows16_positions` of the row length, computed when None)."""
    rb = packed.shape[1]
    offsets, flip = rows16_positions(rb) if positions is None else positions
    at = (ids // PACK16 * (PACK16 * rb))[:, None] + offsets[ids % PACK16]
    return packed.view(-1)[at] ^ flip


def pack16_float(weight: torch.Tensor) -> torch.Tensor:
    """A bfloat16 weight [N, K] in groups of :data:`PACK16` rows, as ``ggml::linear16`` reads a BF16
    weight (``ggml_rows16.h``): per group and pair of columns, the 16 rows' two values; [N, K * 2]
    bytes. N must be a multiple of :data:`PACK16`, K of 4."""
    n, k = weight.shape
    groups = weight.view(n // PACK16, PACK16, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return groups.view(torch.uint8).view(n, k * 2)


def rows16_supported() -> bool:
    """Whether ``ggml::linear16`` runs on this build (compiled where the CPU has AVX-512 VNNI). Needs
    :func:`load`."""
    return _runs("rows16", lambda: torch.ops.ggml.linear16(torch.zeros(1, 32), _zeros(PACK16), TYPE_OF["Q8_0"], PACK16))


def rows16_bf16_supported() -> bool:
    """Whether ``ggml::linear16`` runs BF16 weights on this build (compiled where the CPU has
    AVX512_BF16). Needs :func:`load`."""
    raw = pack16_float(torch.zeros(PACK16, 32, dtype=torch.bfloat16))
    return _runs(
        "rows16-bf16", lambda: torch.ops.ggml.linear16(torch.zeros(1, 32), raw, FLOAT_TYPE_OF[torch.bfloat16], PACK16)
    )


def accepts_rows16_float(w, dt: torch.dtype, device: torch.device) -> bool:
    """What the ``ggml16-bf16`` candidate takes: a float weight [N, K] multiplied in bfloat16, N whole
    :data:`PACK16`-row groups and K a multiple of 4, where this build runs ``ggml::linear16`` on BF16
    weights (:func:`rows16_bf16_supported`)."""
    if not (accepts_float(w, dt, device) and dt == torch.bfloat16):
        return False
    n, k = w.shape
    return n % PACK16 == 0 and k % 4 == 0 and rows16_bf16_supported()


def rows16_float_builder(kernel_class):
    """``build(w, dt)`` for :class:`worker.quant.kernels.Candidate`: a float weight cast to bfloat16,
    sixteen rows at a time in a vector's lanes (``ggml::linear16``, ``ggml_rows16.h``), over the
    weight re-laid out by :func:`pack16_float` (held instead of the plain weight). Its ``native`` form
    takes float32 rows (rounded to bfloat16 inside) and returns the float32 sums (an LM head's
    logits); a tied embedding reads its rows from the packed weight."""

    def build(w: torch.Tensor, dt: torch.dtype):
        n, k = w.shape
        raw = pack16_float(w.detach().to(torch.bfloat16).contiguous())
        t, linear16 = FLOAT_TYPE_OF[torch.bfloat16], torch.ops.ggml.linear16
        fn = lambda x: linear16(x, raw, t, n)  # noqa: E731
        groups = raw.view(torch.bfloat16).view(n // PACK16, k // 2, PACK16, 2)
        gather = lambda ids: groups[ids // PACK16, :, ids % PACK16].reshape(len(ids), k).float()  # noqa: E731
        return kernel_class("ggml16-bf16", fn, (raw,), native=(torch.float32, fn), gather=gather)

    return build


def accepts_rows16(w, dt: torch.dtype, device: torch.device) -> bool:
    """What the ``ggml16`` candidate takes: Q8_0 blocks (:data:`ROWS16_TYPES`) of a whole number of
    :data:`PACK16`-row groups, where this build runs ``ggml::linear16`` (:func:`rows16_supported`)."""
    return accepts(w, dt, device) and w.ggml_type in ROWS16_TYPES and w.shape[0] % PACK16 == 0 and rows16_supported()


def rows16_builder(kernel_class):
    """``build(w, dt)`` for :class:`worker.quant.kernels.Candidate`: Q8_0 weights sixteen rows at a time,
    one vector lane each (``ggml::linear16``, ``worker/quant/csrc/ggml_rows16.h``), over the blocks
    re-laid out by :func:`pack16`. Holds the packed blocks only (a tied embedding reads its rows from
    them)."""

    def build(w, dt: torch.dtype):
        t, (n, k) = w.ggml_type, w.shape
        packed = pack16(w.blocks.contiguous(), t, n)
        linear16, positions = torch.ops.ggml.linear16, rows16_positions(packed.shape[1])
        gather = lambda ids: dequantize(unpacked16_rows(packed, ids, positions), t, k)  # noqa: E731
        return kernel_class("ggml16", lambda x: linear16(x, packed, t, n), (packed,), gather=gather)

    return build


def accepts_float(w, dt: torch.dtype, device: torch.device) -> bool:
    """A float weight on a CPU, for float32 or bfloat16 activations (multiplied in that dtype)."""
    return isinstance(w, torch.Tensor) and device.type == "cpu" and dt in (torch.float32, torch.bfloat16)


def float_builder(kernel_class):
    """``build(w, dt)`` for :class:`worker.quant.kernels.Candidate`: ggml's ``vec_dot`` of the weight cast
    to ``dt`` (F32's, with FMA, or BF16's, with ``avx512_bf16``'s dot products where the CPU has them:
    what llama.cpp runs for one row of a float GGUF's weights), over rows of ``x`` read as they are.
    Holds the weight in ``dt`` only (the same storage as a weight already in it). BF16's sums are in
    float32 and rounded to bfloat16 on the way out: its ``native`` form takes float32 rows (rounded to
    bfloat16 inside, as ``x.to(bfloat16)`` rounds them) and returns the float32 sums (an LM head's
    logits, :meth:`worker.llama.LlamaModel.head`)."""

    def build(w: torch.Tensor, dt: torch.dtype):
        weight = w.detach().to(dt).contiguous()  # [N, K]
        raw, t, n = weight.view(torch.uint8), FLOAT_TYPE_OF[dt], weight.shape[0]  # raw: [N, K * bytes]
        linear = torch.ops.ggml.linear
        fn = lambda x: linear(x, raw, t, n)  # noqa: E731
        native = (torch.float32, fn) if dt == torch.bfloat16 else None
        return kernel_class("ggml-float", fn, (weight,), native=native)

    return build


# ggml types llamafile's tinyBLAS multiplies (ggml::gemm): Q8_0 and Q4_0 blocks against Q8_0 activations
TINYBLAS_TYPES = (8, 2)
TINYBLAS_K = 32  # a row length tinyBLAS takes whole on every CPU (its widest float vector: BF16's 32 values)
TINYBLAS_M = 4  # float weights: output rows in tiles of 4 (sgemm.cpp's tinyBLAS::matmul)


def accepts_tinyblas(w, dt: torch.dtype, device: torch.device) -> bool:
    """What ``ggml::gemm`` takes (llamafile's sgemm.cpp, ``llamafile_sgemm``): Q8_0 / Q4_0 blocks, or a
    float weight [N, K] with K a multiple of :data:`TINYBLAS_K` and N of :data:`TINYBLAS_M` (multiplied
    in ``dt``, float32 or bfloat16), on a CPU. A CPU whose tinyBLAS takes less (an AVX2 build's BF16
    without avx512_bf16 computes in float32 vectors) makes the operator raise, and the candidate is then
    not eligible (:func:`worker.quant.kernels.check`)."""
    if device.type != "cpu" or dt not in (torch.float32, torch.bfloat16):
        return False
    if isinstance(w, torch.Tensor):
        n, k = w.shape
        return k % TINYBLAS_K == 0 and n % TINYBLAS_M == 0
    return getattr(w, "blocks", None) is not None and w.ggml_type in TINYBLAS_TYPES


def tinyblas_builder(kernel_class):
    """``build(w, dt)`` for :class:`worker.quant.kernels.Candidate`: llamafile's tinyBLAS (``ggml::gemm``)
    over a weight's ggml blocks (activations as Q8_0 blocks) or over a float weight cast to ``dt``
    (F32's FMA tiles, BF16's ``avx512_bf16`` dot products: what llama.cpp runs for a float GGUF's
    prompt). Each output keeps its own accumulator in k order whatever tile the row count selects, but
    it is not declared row-invariant: a deterministic table checks it per shape. A bfloat16 weight's
    ``native`` form takes float32 rows and returns the float32 sums (an LM head's logits)."""

    def build(w, dt: torch.dtype):
        gemm, n, k = torch.ops.ggml.gemm, w.shape[0], w.shape[1]
        if isinstance(w, torch.Tensor):
            weight = w.detach().to(dt).contiguous()  # [N, K]
            raw, t = weight.view(torch.uint8), FLOAT_TYPE_OF[dt]  # raw: [N, K * bytes]
            fn = lambda x: gemm(x, raw, t, n)  # noqa: E731
            native = (torch.float32, fn) if dt == torch.bfloat16 else None
            return kernel_class("tinyblas", fn, (weight,), native=native)
        blocks, t = w.blocks.contiguous(), w.ggml_type
        gather = lambda ids: dequantize(blocks.index_select(0, ids), t, k)  # noqa: E731
        return kernel_class("tinyblas", lambda x: gemm(x, blocks, t, n), (blocks,), gather=gather)

    return build


def tolerance(dequantized: bool, dt: torch.dtype, exact: float, half: float, q8: float) -> float:
    """The eligibility tolerance: the dequantized form is exact in the weights (``exact`` in float32,
    ``half`` in bfloat16); ``vec_dot`` rounds the activations to 8 bits per block of 32 (Q8_0/Q8_1) or
    256 (Q8_K), an error per product as :data:`worker.quant.kernels.TOL_BF16_SUM` bounds (``q8``)."""
    if dequantized:
        return exact if dt == torch.float32 else half
    return q8 if dt == torch.float32 else max(q8, half)
