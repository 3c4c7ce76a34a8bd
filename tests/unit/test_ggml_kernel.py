"""The ggml operator (``torch.ops.ggml``, worker/quant/csrc/ggml_linear.cpp) against the reference: the
``gguf`` package's dequantization of the same blocks followed by ``F.linear`` in float64; float weights
(F32, F16, BF16) against ``F.linear`` of the same weight.

Tolerance (as :func:`worker.quant.kernels.check` measures: the largest error over the largest value
rounding could reach, ``max(|x| @ |W|.T)``): ggml rounds each activation to 8 bits per block of 32
(Q8_0, Q8_1) or 256 (Q8_K): at most half a step of ``max|x| / 127`` per value, a few 1e-3 of the bound
on Gaussian rows summed over 512 products; :data:`TOL_Q8` = 6e-3 (``kernels.TOL_BF16_SUM``), and the
outputs of a bfloat16 call add bfloat16's rounding (2^-9 of a value). Needs the operator built by
``scripts/setup.sh`` (skipped, saying so, where it was not built: CI runs set-up, so there they run).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from worker.quant import ggml_kernel, invariance
from worker.quant.format import quantize_int8
from worker.quant.kernels import (
    TOL_BF16_SUM,
    TOL_FLOAT32,
    Kernel,
    candidates,
    check,
    full_precision,
    head_pool,
)

pytestmark = pytest.mark.skipif(
    not ggml_kernel.load(), reason=f"the ggml operator is not built here ({ggml_kernel.library_path()} absent)"
)

TOL_Q8 = TOL_BF16_SUM
TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q6_K]
CPU = torch.device("cpu")
N, K = 72, 512  # 72 output rows: not a multiple of the operator's 16-row chunks


def weight(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32) * 0.05


def relative_error(got: torch.Tensor, x: torch.Tensor, w: np.ndarray) -> float:
    ref = torch.from_numpy(w).double()
    want = F.linear(x.double(), ref)
    bound = F.linear(x.double().abs(), ref.abs()).amax()
    return float((got.double() - want).abs().amax() / bound)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 7, 64])
def test_linear_matches_gguf_dequantization(qtype, rows):
    blocks = ggml_kernel.quantize(torch.from_numpy(weight()), qtype.name)
    assert tuple(blocks.shape) == (N, ggml_kernel.row_bytes(int(qtype), K))
    reference = dequantize(blocks.numpy(), qtype).reshape(N, K)  # gguf's own unpacking of the blocks
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    got = torch.ops.ggml.linear(x, blocks, int(qtype), N)
    assert got.dtype == torch.float32 and tuple(got.shape) == (rows, N)
    assert relative_error(got, x, reference) <= TOL_Q8
    half = torch.ops.ggml.linear(x.bfloat16(), blocks, int(qtype), N)
    assert half.dtype == torch.bfloat16
    assert relative_error(half.float(), x.bfloat16().float(), reference) <= TOL_Q8 + 2**-8


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1], ids=lambda t: t.name)
def test_quantize_writes_ggufs_blocks(qtype):
    """ggml_quantize_chunk and the gguf package's reference quantizer agree on the bytes."""
    w = weight(1)
    ours = ggml_kernel.quantize(torch.from_numpy(w), qtype.name).numpy()
    theirs = quantize(w, qtype).reshape(ours.shape)
    assert (ours != theirs).mean() < 1e-3  # a rounding tie may land differently in C and numpy


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_is_ggufs(qtype):
    blocks = ggml_kernel.quantize(torch.from_numpy(weight(2)), qtype.name)
    ids = torch.tensor([5, 0, 71])
    got = ggml_kernel.dequantize(blocks.index_select(0, ids), int(qtype), K)
    want = dequantize(blocks.numpy(), qtype).reshape(N, K)[ids.numpy()]
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_1, T.Q4_K], ids=lambda t: t.name)
def test_rows_do_not_depend_on_what_shares_the_call(qtype):
    blocks = ggml_kernel.quantize(torch.from_numpy(weight(3)), qtype.name)
    x = torch.randn(64, K, generator=torch.Generator().manual_seed(7))
    together = torch.ops.ggml.linear(x, blocks, int(qtype), N)
    for r in (0, 1, 33, 63):
        alone = torch.ops.ggml.linear(x[r : r + 1], blocks, int(qtype), N)
        assert torch.equal(alone[0], together[r])


@pytest.mark.parametrize("threads", [1, 2])
def test_loops_run_on_torchs_threads(threads):
    """The operator's loops share torch's thread count (a build without OpenMP would run them on one
    thread whatever torch is set to), and a row's values do not change with it."""
    blocks = ggml_kernel.quantize(torch.from_numpy(weight(4)), "Q8_0")
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(3))
    linear = torch.ops.ggml.linear
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = linear(x, blocks, int(T.Q8_0), N)
        torch.set_num_threads(threads)
        assert torch.ops.ggml.threads() == threads
        assert torch.equal(linear(x, blocks, int(T.Q8_0), N), alone)
    finally:
        torch.set_num_threads(before)


def test_refuses_rows_that_are_not_whole_blocks():
    blocks = ggml_kernel.quantize(torch.from_numpy(weight()), "Q8_0")
    with pytest.raises(RuntimeError, match=r"(?i)not whole q8_0 blocks"):
        torch.ops.ggml.linear(torch.randn(1, K - 16), blocks, int(T.Q8_0), N)
    with pytest.raises(RuntimeError, match="not whole"):
        ggml_kernel.quantize(torch.randn(4, 48), "Q8_0")


def test_fake_implementation_traces():
    """The registered fake gives the shapes, so torch.compile can trace around the operator."""
    blocks = ggml_kernel.quantize(torch.from_numpy(weight()), "Q4_0")
    args = (torch.randn(3, K), blocks, int(T.Q4_0), N)
    torch.library.opcheck(torch.ops.ggml.linear.default, args, test_utils=("test_schema", "test_faketensor"))


# ---- float weights (F32, F16, BF16: the tensor's bytes are ggml's rows) --------------------------------

# F32 weights and float32 activations: float32 sums of K products, far inside TOL_FLOAT32 (1e-4 of the
# bound). Otherwise at most two roundings of 2^-9 of the bound each: the activations rounded to the
# weight's type (bfloat16 2^-9, float16 2^-11 per value) and a bfloat16 output (2^-9 of a value).
TOL_F32 = TOL_FLOAT32
TOL_ROUNDED = 2**-7
FLOAT_WEIGHTS = [torch.float32, torch.float16, torch.bfloat16]
KF = 600  # not a multiple of the 64 values a BF16 / F32 vec_dot step takes: its scalar tail runs too


def float_call(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``torch.ops.ggml.linear`` of ``x`` and the float weight ``w`` as it is (its bytes: ggml's rows)."""
    t = ggml_kernel.FLOAT_TYPE_OF[w.dtype]
    return torch.ops.ggml.linear(x, w.contiguous().view(torch.uint8), t, w.shape[0])


@pytest.mark.parametrize("wdt", FLOAT_WEIGHTS, ids=str)
@pytest.mark.parametrize("xdt", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 2, 7, 64])
def test_float_weights_match_f_linear(wdt, xdt, rows):
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(N, KF, generator=g) * 0.05).to(wdt)
    x = torch.randn(rows, KF, generator=g).to(xdt)
    got = float_call(w, x)
    assert got.dtype == xdt and tuple(got.shape) == (rows, N)
    tol = TOL_F32 if wdt == xdt == torch.float32 else TOL_ROUNDED
    assert relative_error(got, x.float(), w.float().numpy()) <= tol


@pytest.mark.parametrize("wdt", FLOAT_WEIGHTS, ids=str)
@pytest.mark.parametrize("k", [576, KF])
def test_float_rows_do_not_depend_on_what_shares_the_call(wdt, k):
    """One row runs ggml's ``vec_dot``; several run it tiled where the row is whole 64-value steps (576):
    the same values, bit for bit."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(N + 1, k, generator=g).to(wdt)  # an odd count: a tile of one weight row too
    for xdt in (torch.float32, torch.bfloat16):
        x = torch.randn(64, k, generator=g).to(xdt)
        together = float_call(w, x)
        for r in (0, 1, 33, 63):
            assert torch.equal(float_call(w, x[r : r + 1])[0], together[r])
        for count in (2, 3, 5, 7):  # every remainder of the tiles' rows
            assert torch.equal(float_call(w, x[:count]), together[:count])


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 2, 7, 64])
def test_the_float_candidate_matches_f_linear(dt, rows):
    """``ggml-f32`` / ``ggml-bf16`` of :func:`worker.quant.kernels.candidates` on the model's shapes (K
    576: qkv, gate/up, the LM head; 1536: down): eligible, in the compute dtype, within its tolerance
    (TOL_FLOAT32 / TOL_HALF: the activations and outputs in bfloat16) of ``F.linear`` in float64."""
    cand = next(c for c in candidates(dt, CPU) if c.name == f"ggml-{'f32' if dt == torch.float32 else 'bf16'}")
    for n, k in ((96, 576), (40, 1536)):
        g = torch.Generator().manual_seed(n * rows)
        w = (torch.randn(n, k, generator=g) * 0.05).to(dt)
        kernel = check(cand, w, dt, CPU)
        assert kernel is not None, f"{cand.name} not eligible for {n}x{k}"
        x = torch.randn(rows, k, generator=g).to(dt)
        with torch.inference_mode():
            got = kernel.fn(x)
        assert got.dtype == dt and tuple(got.shape) == (rows, n)
        assert relative_error(got, x.float(), w.float().numpy()) <= cand.tolerance


def test_a_float_weight_is_held_once():
    w = torch.randn(N, KF).bfloat16()
    kernel = ggml_kernel.float_builder(Kernel)(w, torch.bfloat16)
    assert [t.untyped_storage().data_ptr() for t in kernel.held] == [w.untyped_storage().data_ptr()]


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16], ids=str)
def test_the_float_candidate_passes_the_deterministic_tables_check(dt):
    """At several rows the operator runs ggml's float ``vec_dot`` in tiles (``ggml_float_tiles.h``), at
    one row ggml's own: :func:`worker.quant.invariance.row_invariant` (every row count of a
    deterministic table's, each row alone) finds them equal, bit for bit, on a row of 576 (tiles) and
    of 600 (ggml's ``vec_dot`` at every row count)."""
    for k in (576, 600):
        w = torch.randn(40, k, generator=torch.Generator().manual_seed(k)).to(dt)
        kernel = ggml_kernel.float_builder(Kernel)(w, dt)
        assert invariance.row_invariant(kernel, k, dt, CPU)


def test_a_bfloat16_head_runs_ggml_for_float32_logits():
    """In a bfloat16 model the LM head runs ``ggml-bf16``, ``ggml16-bf16`` (where the CPU has AVX512_BF16) or
    ``tinyblas-bf16`` where they are eligible (:func:`head_pool`): its
    ``native`` form returns the float32 sums that its bfloat16 output rounds, so logits 0.09 apart near
    25 stay apart. A float32 model's head, and a quantized head, keep every full-precision candidate."""
    w = torch.randn(64, 576, generator=torch.Generator().manual_seed(5)) * 0.05
    bf16 = candidates(torch.bfloat16, CPU)
    sixteen = ["ggml16-bf16"] if ggml_kernel.rows16_bf16_supported() else []
    assert [c.name for c in head_pool(bf16, w.bfloat16(), torch.bfloat16, CPU)] == [
        "ggml-bf16",
        *sixteen,
        "tinyblas-bf16",
    ]
    f32 = candidates(torch.float32, CPU)
    assert {"ggml-f32", "plain-f32"} <= {c.name for c in head_pool(f32, w, torch.float32, CPU)}
    every = [c.name for c in bf16 if full_precision(c, torch.bfloat16)]
    assert [c.name for c in head_pool(bf16, quantize_int8(w, 32), torch.bfloat16, CPU)] == every
    kernel = check(next(c for c in bf16 if c.name == "ggml-bf16"), w.bfloat16(), torch.bfloat16, CPU)
    act, wide = kernel.native
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(6)).bfloat16()
    logits = wide(x.float())
    assert act == torch.float32 and logits.dtype == torch.float32
    assert torch.equal(logits.bfloat16(), kernel.fn(x))
