"""Kernel candidates for one linear layer: ``x [T, K] -> x @ W.T [T, N]``, each built from a float
weight or a :class:`~worker.quant.format.QuantizedWeight`.

Every candidate comes from torch itself (no kernel of our own): plain ``F.linear`` (MKL or oneDNN
underneath on CPU, cuBLAS on CUDA), oneDNN's prepacked linear (``mkldnn._linear_pointwise``,
inductor's weight freezing), torch's weight-only ops ``_weight_int8pack_mm`` (one scale per output
channel), ``_weight_int4pack_mm_for_cpu`` / ``_weight_int4pack_mm`` (int4 per group, CPU / CUDA)
and ``_dyn_quant_matmul_4bit`` (symmetric int4, activations quantized to int8 on the fly), and
``dequant`` (the float weight rebuilt from its quantized form at every call: slow, but it runs
anywhere and holds nothing more than the quantized weight).

A candidate is *eligible* for a weight only when it builds and its output on a few random rows
matches ``F.linear`` on the dequantized float32 weight within its tolerance (:func:`check`): a kernel
this CPU cannot run (oneDNN's bfloat16 prepack on a CPU without avx512bw/avx_ne_convert raises),
that another torch build lacks, or that computes something else is never chosen. Which eligible
candidate runs is measured, per weight shape and row count (:mod:`worker.quant.autotune`).

Each kernel returns its output in the input's dtype (the model's compute dtype), whatever it
computes in internally. One that casts to a dtype of its own also offers itself without the casts
(:attr:`Kernel.native`), for a caller whose neighbouring operations take that dtype as they are.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.quant import ggml_kernel, grouped_int8, split_int4
from worker.quant.format import QuantizedWeight

log = logging.getLogger(__name__)

Weight = torch.Tensor | QuantizedWeight

# Tolerances of the eligibility check: max |candidate - reference| over the bound max (|x| @ |W|.T),
# the largest value rounding could reach. Float32 math rounds at 2^-24 per step; bfloat16 inputs and
# outputs at 2^-9 each (a few steps of it); int8 activations (``_dyn_quant_matmul_4bit``) at
# max|x| / 254 per value, a few percent of the bound on Gaussian rows.
TOL_FLOAT32 = 1e-4
TOL_HALF = 2e-2  # bfloat16 / float16 activations or weights
TOL_INT8_ACTIVATIONS = 6e-2
# bfloat16 activations and scales, each group's product rounded to bfloat16 and the products summed in
# float32 (:mod:`worker.quant.grouped_int8`, :mod:`worker.quant.split_int4`): three roundings of 2^-9 at worst, and no bfloat16 grid
# on the output (the sum of products of different sizes is not on it). Measured ~1e-3 on an LM head.
TOL_BF16_SUM = 6e-3

INT4_CPU_GROUPS = (32, 64, 128, 256)  # group sizes _weight_int4pack_mm_for_cpu takes


@dataclass
class Kernel:
    """A built candidate: ``fn`` maps ``x [T, K]`` to ``[T, N]`` in ``x``'s dtype; ``held`` are the
    tensors it keeps alive (what it costs in memory, counted once per storage); ``gather``, where the
    kernel re-laid the weight out, maps ``ids [T]`` to those rows of the weight [T, K] float32 read
    from its own tensors (a tied embedding table then shares them instead of holding a second copy);
    ``native``, where ``fn`` casts ``x`` to a dtype of its own and its output back, is that dtype and
    the kernel without the two casts (input and output in that dtype: what ``fn`` computes between them);
    ``twin``, the kernel whose values it computes by construction (:attr:`Candidate.twin`)."""

    name: str
    fn: Callable[[torch.Tensor], torch.Tensor]
    held: tuple[torch.Tensor, ...]
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None
    native: tuple[torch.dtype, Callable[[torch.Tensor], torch.Tensor]] | None = None
    twin: str | None = None  # its candidate's twin (Candidate.twin), set when the table builds it

    def storages(self) -> set[int]:
        """The storages of :attr:`held` (:func:`storage_key`): what two kernels share."""
        return {storage_key(t) for t in self.held}


def storage_key(t: torch.Tensor) -> int:
    """One key per storage (a plain weight and a view of it count once); opaque tensors (oneDNN's
    packed layout) have no accessible storage and count as themselves."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return id(t)


@dataclass(frozen=True)
class Candidate:
    """One way to multiply by a weight. ``accepts(weight, dtype, device)`` is the cheap static test
    (bits, group size, device); ``build(weight, dtype)`` makes the :class:`Kernel` and may raise
    (a missing op, an unsupported CPU). ``tolerance`` bounds :func:`check`. ``copy``: it holds a
    float copy of a quantized weight (more memory than the quantized form; see autotune).
    ``invariant``: each output row is computed from its own input row alone, in an order that does not
    depend on how many rows share the call (ggml's per-row ``vec_dot``), so a sequence's values do not
    change with its batch; False where that is not known (BLAS and oneDNN choose blockings by shape).
    ``wide_logits``: in a bfloat16 / float16 model its kernel's ``native`` form returns the float32
    sums before they are rounded to the compute dtype (what an LM head's logits want: see
    :func:`head_pool`). ``twin``: the candidate whose values this one computes bit for bit by
    construction (the same products summed in the same order: llamafile's tinyBLAS and ggml's
    ``vec_dot`` on Q8_0 / Q4_0 blocks on x86), so a deterministic table may run either at any bucket
    once it has checked that here (:func:`worker.quant.invariance.per_bucket`)."""

    name: str
    tolerance: float
    accepts: Callable[[Weight, torch.dtype, torch.device], bool]
    build: Callable[[Weight, torch.dtype], Kernel]
    copy: bool = False
    invariant: bool = False
    wide_logits: bool = False
    twin: str | None = None


def _is_float(w: Weight) -> bool:
    return isinstance(w, torch.Tensor)


def _to(dt: torch.dtype, fn):
    """``fn`` computing in ``dt``, taking and returning the caller's dtype."""
    return lambda x: fn(x.to(dt)).to(x.dtype)


def _casting(name: str, act: torch.dtype, dt: torch.dtype, raw, held: tuple[torch.Tensor, ...]) -> Kernel:
    """A kernel whose op ``raw`` computes in ``act``: itself for a ``dt`` caller when ``dt`` is ``act``,
    else wrapped in casts (:func:`_to`) and offered without them (:attr:`Kernel.native`)."""
    if act == dt:
        return Kernel(name, raw, held)
    return Kernel(name, _to(act, raw), held, native=(act, raw))


# ---- float weights ----------------------------------------------------------------------------


def _plain(w: Weight, dt: torch.dtype) -> Kernel:
    weight = w.to(dt) if _is_float(w) else w.dequantize(dt)
    return Kernel("plain", lambda x: F.linear(x, weight), (weight,))


def _onednn(w: Weight, dt: torch.dtype) -> Kernel:
    weight = (w if _is_float(w) else w.dequantize(torch.float32)).to(dt)
    with torch.no_grad():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    kernel = torch.ops.mkldnn._linear_pointwise
    return Kernel("onednn", lambda x: kernel(x, packed, None, "none", [], ""), (packed,))


# ---- quantized weights ------------------------------------------------------------------------


def _per_channel_int8(w: Weight, dt: torch.dtype, device: torch.device) -> bool:
    return not _is_float(w) and w.bits == 8 and w.group_size == w.shape[1]


def _int8pack(act: torch.dtype):
    def build(w: QuantizedWeight, dt: torch.dtype) -> Kernel:
        q = w.q.contiguous()
        scale = w.scale.reshape(-1).to(act).contiguous()  # [N]: one scale per output channel
        op = torch.ops.aten._weight_int8pack_mm
        return _casting(f"int8pack-{_short(act)}", act, dt, lambda x: op(x, q, scale), (q, scale))

    return build


def _int4_groups(w: Weight, dt: torch.dtype, device: torch.device) -> bool:
    return not _is_float(w) and w.bits == 4 and w.group_size in INT4_CPU_GROUPS and device.type == "cpu"


def _scales_and_zeros(w: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """[K / group, N, 2]: torch's int4 ops compute ``(q - 8) * scale + zero``; ours is
    ``q * scale + offset``, so ``zero = offset + 8 * scale``."""
    zero = w.offset + 8 * w.scale
    return torch.stack([w.scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)


def _int4pack_cpu(act: torch.dtype):
    def build(w: QuantizedWeight, dt: torch.dtype) -> Kernel:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.q.to(torch.int32), 1)  # [N, K / 2]
        sz = _scales_and_zeros(w, act)
        g, op = w.group_size, torch.ops.aten._weight_int4pack_mm_for_cpu
        return _casting(f"int4pack-{_short(act)}", act, dt, lambda x: op(x, packed, g, sz), (packed, sz))

    return build


def _symmetric_int4(w: Weight, dt: torch.dtype, device: torch.device) -> bool:
    """Q4_0-style groups (``offset == -8 * scale``): what ``_dyn_quant_matmul_4bit`` stores."""
    return (
        not _is_float(w)
        and w.bits == 4
        and device.type == "cpu"
        and w.shape[1] % w.group_size == 0
        and bool(torch.equal(w.offset, -8 * w.scale))
    )


def _dynquant4(w: QuantizedWeight, dt: torch.dtype) -> Kernel:
    n, k = w.shape
    nibbles = w.q[:, 1::2] << 4 | w.q[:, ::2]  # [N, K / 2]: the even column in the low nibble
    packed = torch.ops.aten._dyn_quant_pack_4bit_weight(
        nibbles.to(torch.uint8), w.scale.to(torch.float32), None, w.group_size, k, n
    )
    op, g = torch.ops.aten._dyn_quant_matmul_4bit, w.group_size
    return _casting("dynquant4", torch.float32, dt, lambda x: op(x, packed, g, k, n), (packed,))


def _dequant(w: QuantizedWeight, dt: torch.dtype) -> Kernel:
    return Kernel(
        "dequant", lambda x: F.linear(x, w.dequantize(dt)), tuple(t for t in (w.q, w.scale, w.offset) if t is not None)
    )


def _float_copy(act: torch.dtype):
    def build(w: QuantizedWeight, dt: torch.dtype) -> Kernel:
        weight = w.dequantize(act)
        return _casting(f"float-copy-{_short(act)}", act, dt, lambda x: F.linear(x, weight), (weight,))

    return build


# ---- CUDA -------------------------------------------------------------------------------------


def _int4_cuda_ok(w: Weight, dt: torch.dtype, device: torch.device) -> bool:
    return (
        device.type == "cuda"
        and not _is_float(w)
        and w.bits == 4
        and w.group_size in (32, 64, 128, 256)
        and _inner_k_tiles(w.shape[1]) is not None
        and w.shape[0] % 8 == 0
    )


def _inner_k_tiles(k: int) -> int | None:
    """The largest of torch's CUDA int4 tilings (8, 4, 2 tiles of 16 along K) that divides ``k``."""
    return next((t for t in (8, 4, 2) if k % (t * 16) == 0), None)


def _int4pack_cuda(w: QuantizedWeight, dt: torch.dtype) -> Kernel:
    nibbles = (w.q[:, ::2] << 4 | w.q[:, 1::2]).to(torch.uint8)  # [N, K / 2]: gpt-fast's order
    packed = torch.ops.aten._convert_weight_to_int4pack(nibbles.contiguous(), _inner_k_tiles(w.shape[1]))
    sz = _scales_and_zeros(w, torch.bfloat16)
    g, op = w.group_size, torch.ops.aten._weight_int4pack_mm
    return _casting("int4pack-cuda", torch.bfloat16, dt, lambda x: op(x, packed, g, sz), (packed, sz))


# ---- the lists --------------------------------------------------------------------------------


def _short(dt: torch.dtype) -> str:
    return {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}[dt]


def _float_weight(w, dt, device) -> bool:
    return _is_float(w)


def _quantized(w, dt, device) -> bool:
    return not _is_float(w)


def _cpu(test):
    return lambda w, dt, device: device.type == "cpu" and test(w, dt, device)


def _tol(dt: torch.dtype) -> float:
    return TOL_FLOAT32 if dt == torch.float32 else TOL_HALF


def full_precision(candidate: Candidate, dt: torch.dtype) -> bool:
    """Whether ``candidate`` may run a ``dt`` model's LM head: its output is not rounded to a grid
    coarser than ``dt``'s (logits feed sampling and logprobs; bfloat16 logits near 25 move in steps
    of 0.125, enough to make ties). Kernels at ``dt``'s own precision qualify, and so do those that
    round activations to bfloat16 but sum their products in float32 (:data:`TOL_BF16_SUM`: an error
    per product like llama.cpp's 8-bit activations, no coarse steps)."""
    return candidate.tolerance <= max(_tol(dt), TOL_BF16_SUM)


def head_pool(pool: list[Candidate], w: Weight, dt: torch.dtype, device: torch.device) -> list[Candidate]:
    """The candidates an LM head ``w`` of a ``dt`` model may run: :func:`full_precision` ones, and in a
    bfloat16 / float16 model only those returning float32 logits (``wide_logits``) where any takes
    ``w``: logits rounded to bfloat16 tie two tokens whose float32 logits differ by less than the
    grid (0.125 near 25), and which of them greedy decoding takes then depends on the kernel."""
    pool = [c for c in pool if full_precision(c, dt)]
    wide = [c for c in pool if c.wide_logits and c.accepts(w, dt, device)] if dt != torch.float32 else []
    return wide or pool


def candidates(dt: torch.dtype, device: torch.device) -> list[Candidate]:
    """Every candidate for compute dtype ``dt`` on ``device``'s kind, whatever the weight; each
    says itself which weights it takes (:attr:`Candidate.accepts`)."""
    half = TOL_HALF
    out = [
        Candidate(f"plain-{_short(dt)}", _tol(dt), _float_weight, _plain),
        Candidate(f"dequant-{_short(dt)}", _tol(dt), _quantized, _dequant),
        Candidate("int8pack-bf16", half, _per_channel_int8, _int8pack(torch.bfloat16)),
    ]
    if device.type == "cpu":
        out += [
            Candidate(f"onednn-{_short(dt)}", _tol(dt), _cpu(_float_weight), _onednn),
            Candidate("int8pack-f32", _tol(dt), _cpu(_per_channel_int8), _int8pack(torch.float32)),
            Candidate(
                "int8group-bf16", TOL_BF16_SUM, grouped_int8.accepts, grouped_int8.builder(torch.bfloat16, Kernel)
            ),
            Candidate(
                "int8split-bf16",
                TOL_BF16_SUM,
                grouped_int8.accepts_split,
                grouped_int8.builder(torch.bfloat16, Kernel, grouped_int8.SPLIT),
            ),
            Candidate("int8group-f32", _tol(dt), grouped_int8.accepts, grouped_int8.builder(torch.float32, Kernel)),
            Candidate("int4pack-bf16", half, _int4_groups, _int4pack_cpu(torch.bfloat16)),
            Candidate("int4pack-f32", _tol(dt), _int4_groups, _int4pack_cpu(torch.float32)),
            Candidate(
                "int4split-bf16", TOL_BF16_SUM, split_int4.accepts, split_int4.builder(Kernel, _scales_and_zeros)
            ),
            Candidate("dynquant4", TOL_INT8_ACTIVATIONS, _symmetric_int4, _dynquant4),
            Candidate("float-copy-f32", _tol(dt), _cpu(_quantized), _float_copy(torch.float32), copy=True),
            Candidate("float-copy-bf16", half, _cpu(_quantized), _float_copy(torch.bfloat16), copy=True),
        ]
        out += _ggml(dt) if ggml_kernel.load() else []
    else:
        out += [
            Candidate("int4pack-cuda", half, _int4_cuda_ok, _int4pack_cuda),
            Candidate(f"float-copy-{_short(dt)}", _tol(dt), _quantized, _float_copy(dt), copy=True),
        ]
    return out


def _ggml(dt: torch.dtype) -> list[Candidate]:
    """llama.cpp's kernels over a weight's ggml blocks (:mod:`worker.quant.ggml_kernel`): ``vec_dot``
    (row-count invariant), the same sums four weight rows at a time over the blocks re-laid out in
    groups (``ggml4``: Q8_0 / Q4_0, ``vec_dot``'s twin), Q8_0 sixteen weight rows at a time in a
    vector's lanes (``ggml16``: row-count invariant, its own sums; ``ggml16-bf16`` the same for a float
    weight in bfloat16, where the CPU has AVX512_BF16) and the blocks dequantized per call for
    ``F.linear``; for a float weight,
    ggml's float ``vec_dot`` in the compute dtype (its several-row tiles compute ggml's sums bit for
    bit where they run; not declared invariant, so a deterministic table checks it like BLAS); and
    llamafile's tinyBLAS (ggml's prompt-processing GEMM) for float, Q8_0 and Q4_0 weights, likewise
    checked per shape."""
    blocks_tol = ggml_kernel.tolerance(False, dt, TOL_FLOAT32, TOL_HALF, TOL_BF16_SUM)  # 8-bit activations
    return [
        Candidate(
            f"ggml-{_short(dt)}",
            _tol(dt),
            ggml_kernel.accepts_float,
            ggml_kernel.float_builder(Kernel),
            wide_logits=dt == torch.bfloat16,
        ),
        Candidate(
            "ggml",
            blocks_tol,
            ggml_kernel.accepts,
            ggml_kernel.builder(Kernel),
            invariant=True,
        ),
        Candidate(
            "ggml4",
            blocks_tol,
            ggml_kernel.accepts_packed,
            ggml_kernel.packed_builder(Kernel),
            invariant=True,
            twin="ggml",
        ),
        *_ggml16(dt, blocks_tol),
        Candidate(
            f"tinyblas-{_short(dt)}",
            _tol(dt),
            lambda w, d, dev: ggml_kernel.accepts_float(w, d, dev) and ggml_kernel.accepts_tinyblas(w, d, dev),
            ggml_kernel.tinyblas_builder(Kernel),
            wide_logits=dt == torch.bfloat16,
        ),
        Candidate(
            "tinyblas",
            blocks_tol,
            lambda w, d, dev: not _is_float(w) and ggml_kernel.accepts_tinyblas(w, d, dev),
            ggml_kernel.tinyblas_builder(Kernel),
            twin="ggml",
        ),
        Candidate(
            f"ggml-dequant-{_short(dt)}",
            ggml_kernel.tolerance(True, dt, TOL_FLOAT32, TOL_HALF, TOL_BF16_SUM),
            ggml_kernel.accepts,
            ggml_kernel.builder(Kernel, dequantized=True),
        ),
    ]


def _ggml16(dt: torch.dtype, blocks_tol: float) -> list[Candidate]:
    """The sixteen-row forms (``ggml_rows16.h``): Q8_0 blocks (``ggml16``, AVX-512 VNNI) and a float
    weight in bfloat16 (``ggml16-bf16``, AVX512_BF16), each row-invariant by construction with sums of
    its own (no twin)."""
    return [
        Candidate("ggml16", blocks_tol, ggml_kernel.accepts_rows16, ggml_kernel.rows16_builder(Kernel), invariant=True),
        Candidate(
            "ggml16-bf16",
            _tol(dt),
            ggml_kernel.accepts_rows16_float,
            ggml_kernel.rows16_float_builder(Kernel),
            invariant=True,
            wide_logits=True,
        ),
    ]


def reference(w: Weight) -> torch.Tensor:
    """The float32 weight every candidate is checked against."""
    return w.detach().to(torch.float32) if _is_float(w) else w.dequantize(torch.float32)


def check(candidate: Candidate, w: Weight, dt: torch.dtype, device: torch.device, rows: int = 3) -> Kernel | None:
    """Build ``candidate`` for ``w`` and compare it with ``F.linear`` on the dequantized float32
    weight over ``rows`` random rows; the kernel when it matches within ``candidate.tolerance``,
    else ``None`` (logged at INFO: why it is not eligible here)."""
    if not candidate.accepts(w, dt, device):
        return None
    k = w.shape[1]
    try:
        with torch.inference_mode():
            kernel = candidate.build(w, dt)
            kernel.name = candidate.name
            g = torch.Generator(device="cpu").manual_seed(0)
            x = torch.randn(rows, k, generator=g).to(device)
            ref = reference(w).to(device)
            want = F.linear(x, ref)
            got = kernel.fn(x.to(dt))
            bound = F.linear(x.abs(), ref.abs()).amax().clamp_min(1e-12)
            err = float(((got.float() - want).abs().amax() / bound).item())
    except (RuntimeError, NotImplementedError, AttributeError, TypeError, ValueError) as exc:
        log.info("kernel %s cannot run here for %s: %s", candidate.name, tuple(w.shape), str(exc).splitlines()[0])
        return None
    if got.dtype != dt or tuple(got.shape) != (rows, w.shape[0]) or not err <= candidate.tolerance:
        log.info(
            "kernel %s disagrees with F.linear for %s (relative error %.2g > %.2g, %s %s): not eligible",
            candidate.name,
            tuple(w.shape),
            err,
            candidate.tolerance,
            got.dtype,
            tuple(got.shape),
        )
        return None
    return kernel
