"""llamafile's tinyBLAS as a kernel (``torch.ops.ggml.gemm``, worker/quant/csrc/ggml_tinyblas.h): against the
reference per type (Q8_0 / Q4_0 blocks: the ``gguf`` package's dequantization then ``F.linear`` in float64;
F32 / BF16 weights: ``F.linear`` of the same weight), bit for bit row-count invariant on this CPU, equal
to ggml's ``vec_dot`` for the quantized types (so a deterministic table may mix the two per bucket), and
refusing what it cannot take. Tolerances as in tests/unit/test_ggml_kernel.py (the same bound, the same
8-bit activations for the quantized types). Needs the operator built by ``scripts/setup.sh``."""

from __future__ import annotations

import platform

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from tests.helpers.ggml_weights import quantized
from worker.quant import ggml_kernel, invariance
from worker.quant.kernels import TOL_BF16_SUM, TOL_FLOAT32, Kernel, candidates, check

pytestmark = pytest.mark.skipif(
    not ggml_kernel.load(), reason=f"the ggml operator is not built here ({ggml_kernel.library_path()} absent)"
)

CPU = torch.device("cpu")
N, K = 100, 576  # 100 output rows: not a multiple of the 16 rows of each tinyBLAS call
QUANT = [T.Q8_0, T.Q4_0]
FLOATS = {torch.float32: 0, torch.bfloat16: 30}  # weight dtype -> ggml type
X86 = platform.machine() in ("x86_64", "AMD64")


def weight(seed: int = 0, n: int = N, k: int = K) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05)


def relative_error(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    ref = w.double()
    bound = F.linear(x.double().abs(), ref.abs()).amax()
    return float((got.double() - F.linear(x.double(), ref)).abs().amax() / bound)


def rows_of(count: int, seed: int = 1, k: int = K) -> torch.Tensor:
    return torch.randn(count, k, generator=torch.Generator().manual_seed(seed + count))


@pytest.mark.parametrize("qtype", QUANT, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 7, 64])
def test_quantized_gemm_matches_gguf_dequantization(qtype, rows):
    blocks = ggml_kernel.quantize(weight(), qtype.name)
    reference = torch.from_numpy(dequantize(blocks.numpy(), qtype).reshape(N, K))
    x = rows_of(rows)
    got = torch.ops.ggml.gemm(x, blocks, int(qtype), N)
    assert got.dtype == torch.float32 and tuple(got.shape) == (rows, N)
    assert relative_error(got, x, reference) <= TOL_BF16_SUM
    half = torch.ops.ggml.gemm(x.bfloat16(), blocks, int(qtype), N)
    assert half.dtype == torch.bfloat16
    assert relative_error(half.float(), x.bfloat16().float(), reference) <= TOL_BF16_SUM + 2**-8


@pytest.mark.parametrize("wdt", list(FLOATS), ids=str)
@pytest.mark.parametrize("rows", [1, 2, 7, 64])
def test_float_gemm_matches_f_linear(wdt, rows):
    """F32 weights multiply float32 rows (FMA: float32 rounding); BF16 weights bfloat16 rows, the sums
    in float32 (bfloat16's rounding of the inputs, and of the output for a bfloat16 call)."""
    w = weight().to(wdt)
    x = rows_of(rows).to(wdt)
    got = torch.ops.ggml.gemm(x, w.view(torch.uint8), FLOATS[wdt], N)
    assert got.dtype == wdt and tuple(got.shape) == (rows, N)
    assert tuple(torch.ops.ggml.gemm(x[:0], w.view(torch.uint8), FLOATS[wdt], N).shape) == (0, N)
    tol = TOL_FLOAT32 if wdt == torch.float32 else 2**-8
    assert relative_error(got.float(), x.float(), w.float()) <= tol


@pytest.mark.parametrize("what", ["Q8_0", "Q4_0", "float32", "bfloat16"])
def test_rows_do_not_depend_on_what_shares_the_call(what):
    """Every row of every call of 1..128 rows (and 256, and each row alone: the deterministic table's
    own check) equals that row in one call of them all, bit for bit, on this CPU."""
    dt = torch.float32 if what == "float32" else torch.bfloat16
    pool = {c.name: c for c in candidates(dt, CPU)}
    if what in ("Q8_0", "Q4_0"):
        w, name = _quantized(what), "tinyblas"
    else:
        w, name = weight(), f"tinyblas-{'f32' if dt == torch.float32 else 'bf16'}"
    kernel = check(pool[name], w, dt, CPU)
    assert kernel is not None
    assert invariance.row_invariant(kernel, K, dt, CPU)
    x = rows_of(128, seed=9).to(dt)
    together = kernel.fn(x)
    for rows in range(1, 129, 9):
        assert torch.equal(kernel.fn(x[:rows]), together[:rows])


def _quantized(type_name: str):
    return quantized(weight(), type_name)


@pytest.mark.skipif(not X86, reason="the equality is of the x86 (AVX2 / AVX-512) kernels")
@pytest.mark.parametrize("qtype", QUANT, ids=lambda t: t.name)
def test_quantized_gemm_gives_vec_dots_values(qtype):
    """On x86 tinyBLAS_Q0_AVX and ggml's vec_dot multiply each pair of blocks alike (the same integer
    dot products per 32-bit lane, scaled by the product of the two fp16 scales, one FMA into one
    accumulator per output, the same final reduction): the same values bit for bit, so a
    deterministic table may run either at any bucket (:func:`worker.quant.invariance.per_bucket`)."""
    blocks = ggml_kernel.quantize(weight(4), qtype.name)
    for dt in (torch.float32, torch.bfloat16):
        for rows in (1, 2, 3, 8, 17, 64):
            x = rows_of(rows).to(dt)
            gemm = torch.ops.ggml.gemm(x, blocks, int(qtype), N)
            assert torch.equal(gemm, torch.ops.ggml.linear(x, blocks, int(qtype), N))


@pytest.mark.skipif(not X86, reason="the equality is of the x86 (AVX2 / AVX-512) kernels")
def test_a_deterministic_table_runs_vec_dot_or_tinyblas_per_bucket():
    w = _quantized("Q8_0")
    pool = {c.name: c for c in candidates(torch.bfloat16, CPU)}
    built = {n: check(pool[n], w, torch.bfloat16, CPU) for n in ("ggml", "tinyblas")}
    built["ggml"].row_invariant = True  # declared by its candidate
    built["tinyblas"].twin = pool["tinyblas"].twin  # as the table sets it
    times = {"ggml": {1: 1.0, 64: 9.0}, "tinyblas": {1: 2.0, 64: 3.0}}  # fake: tinyBLAS faster at 64 rows
    names = invariance.per_bucket(built, times, [1, 64], K, torch.bfloat16, CPU)
    assert names == ["ggml", "tinyblas"]


def test_refuses_what_it_cannot_take():
    """A float row length that is not whole vectors, an output count that is not whole tiles of 4, or a
    type tinyBLAS has no x86 kernel for: the candidate does not accept it, and the operator raises
    one line naming the weight rather than computing something else."""
    takes = ggml_kernel.accepts_tinyblas
    assert takes(weight(), torch.float32, CPU)
    assert not takes(weight(k=600), torch.float32, CPU)  # 600 values: not whole 32-value vectors
    assert not takes(weight(n=102), torch.bfloat16, CPU)  # 102 outputs: not whole tiles of 4
    assert not takes(weight(), torch.float32, torch.device("meta"))
    q4_1 = ggml_kernel.quantize(weight(), "Q4_1")
    with pytest.raises(RuntimeError, match="Q8_0 and Q4_0"):
        torch.ops.ggml.gemm(rows_of(2), q4_1, int(T.Q4_1), N)
    odd = weight(n=102).bfloat16()
    with pytest.raises(RuntimeError, match="does not take bf16 weights"):
        torch.ops.ggml.gemm(rows_of(2).bfloat16(), odd.view(torch.uint8), 30, 102)


def test_a_float_weight_is_held_once():
    w = weight().bfloat16()
    kernel = ggml_kernel.tinyblas_builder(Kernel)(w, torch.bfloat16)
    assert [t.untyped_storage().data_ptr() for t in kernel.held] == [w.untyped_storage().data_ptr()]
    act, wide = kernel.native  # float32 rows in, the float32 sums out (an LM head's logits)
    x = rows_of(3).bfloat16()
    assert act == torch.float32 and torch.equal(wide(x.float()).bfloat16(), kernel.fn(x))
