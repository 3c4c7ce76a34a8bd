"""ggml's quantized dot products four weight rows at a time (``torch.ops.ggml.linear4`` over blocks packed
by :func:`worker.quant.ggml_kernel.pack4`, worker/quant/csrc/ggml_quant_rows.h): ggml's own ``vec_dot``
values bit for bit, the tied embedding's rows read from the packed layout, and what it refuses. Needs the
operator built by ``scripts/setup.sh``; the equality is of ggml's x86 (AVX2) form."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from tests.helpers.ggml_weights import quantized
from worker.quant import ggml_kernel
from worker.quant.kernels import candidates, check

pytestmark = pytest.mark.skipif(
    not ggml_kernel.load(), reason=f"the ggml operator is not built here ({ggml_kernel.library_path()} absent)"
)

CPU = torch.device("cpu")
N, K = 72, 512
X86 = ggml_kernel.load() and ggml_kernel.packed_supported()
needs_x86 = pytest.mark.skipif(not X86, reason="ggml::linear4 is ggml's x86 (AVX2) form of the dot products")


def weight(n: int = N, k: int = K, seed: int = 5) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32))


@needs_x86
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1], ids=lambda t: t.name)
def test_four_row_groups_give_vec_dots_values_bit_for_bit(qtype):
    """ggml::linear4 over the packed blocks gives ggml's own vec_dot (ggml::linear over the plain blocks)
    bit for bit at every row count (tiles of 1 to 4 activation rows), in float32 and bfloat16, and
    with a short row (K = 96: three blocks)."""
    for k in (K, 96):
        blocks = ggml_kernel.quantize(weight(k=k), qtype.name)
        packed = ggml_kernel.pack4(blocks, int(qtype), N)
        assert packed.shape == blocks.shape and not torch.equal(packed, blocks)
        for rows in (1, 2, 3, 4, 5, 7, 8, 64):
            for dt in (torch.float32, torch.bfloat16):
                x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dt)
                want = torch.ops.ggml.linear(x, blocks, int(qtype), N)
                assert torch.equal(torch.ops.ggml.linear4(x, packed, int(qtype), N), want), (k, rows, dt)


@needs_x86
def test_the_packed_candidate_holds_its_layout_only_and_gathers_rows_from_it():
    """The ggml4 kernel holds the packed blocks alone, and a tied embedding's rows read from them are
    the plain blocks' rows dequantized."""
    w = quantized(weight(), "Q4_0")
    pool = {c.name: c for c in candidates(torch.bfloat16, CPU)}
    kernel = check(pool["ggml4"], w, torch.bfloat16, CPU)
    assert kernel is not None and len(kernel.held) == 1
    assert kernel.storages().isdisjoint({w.blocks.untyped_storage().data_ptr()})
    ids = torch.tensor([0, 3, 4, 71, 5])
    want = ggml_kernel.dequantize(w.blocks.index_select(0, ids), int(T.Q4_0), K)
    assert torch.equal(kernel.gather(ids), want)


def test_the_packed_form_refuses_what_it_cannot_take():
    """Rows that are not whole groups of four, or a type without a four-row form: not accepted, and the
    operator raises one line naming why rather than computing something else. Q4_1, which the operator
    computes, is not offered as a candidate (ggml_kernel.PACKED_TYPES says why)."""
    assert ggml_kernel.accepts_packed(quantized(weight(), "Q8_0"), torch.float32, CPU)
    assert not ggml_kernel.accepts_packed(quantized(weight(), "Q4_1"), torch.float32, CPU)
    assert not ggml_kernel.accepts_packed(quantized(weight(n=70), "Q8_0"), torch.float32, CPU)
    assert not ggml_kernel.accepts_packed(quantized(weight(k=256), "Q4_K"), torch.float32, CPU)
    odd = ggml_kernel.quantize(weight(n=70), "Q8_0")
    with pytest.raises(RuntimeError, match="whole groups of 4"):
        torch.ops.ggml.linear4(torch.randn(1, K), odd, int(T.Q8_0), 70)
    k_quant = ggml_kernel.quantize(weight(k=256), "Q4_K")
    with pytest.raises(RuntimeError, match="linear4"):
        torch.ops.ggml.linear4(torch.randn(1, 256), k_quant, int(T.Q4_K), N)


def test_the_fake_implementation_traces():
    """The registered fake gives the shapes, so torch.compile can trace around the operator."""
    blocks = ggml_kernel.pack4(ggml_kernel.quantize(weight(), "Q4_0"), int(T.Q4_0), N)
    args = (torch.randn(3, K), blocks, int(T.Q4_0), N)
    torch.library.opcheck(torch.ops.ggml.linear4.default, args, test_utils=("test_schema", "test_faketensor"))
