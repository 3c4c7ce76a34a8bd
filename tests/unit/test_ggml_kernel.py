"""The ggml operator (``torch.ops.ggml``, worker/quant/csrc/ggml_linear.cpp) against the reference: the
``gguf`` package's dequantization of the same blocks followed by ``F.linear`` in float64.

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

from worker.quant import ggml_kernel
from worker.quant.kernels import TOL_BF16_SUM

pytestmark = pytest.mark.skipif(
    not ggml_kernel.load(), reason=f"the ggml operator is not built here ({ggml_kernel.library_path()} absent)"
)

TOL_Q8 = TOL_BF16_SUM
TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q6_K]
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
