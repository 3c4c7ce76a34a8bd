"""Q8_0 weights sixteen rows at a time, one vector lane each (``torch.ops.ggml.linear16`` over blocks laid
out by :func:`worker.quant.ggml_kernel.pack16`, worker/quant/csrc/ggml_rows16.h): the same products as
ggml's ``vec_dot`` within float rounding, each output bit for bit the same whatever the rows beside it,
the layout's round trip, and what it refuses; and its bfloat16 form for float weights
(:func:`~worker.quant.ggml_kernel.pack16_float`), whose tied embedding reads the packed rows. Needs the
operator built by ``scripts/setup.sh`` on a CPU with AVX-512 VNNI / AVX512_BF16 (elsewhere the
candidates are not offered, which the tests skipped on this CPU check)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from tests.helpers.ggml_weights import quantized
from worker.quant import ggml_kernel
from worker.quant.kernels import candidates, check
from worker.quant.linear import Linears

pytestmark = pytest.mark.skipif(
    not ggml_kernel.load(), reason=f"the ggml operator is not built here ({ggml_kernel.library_path()} absent)"
)

CPU = torch.device("cpu")
N, K = 80, 512
Q8 = int(T.Q8_0)
VNNI = ggml_kernel.load() and ggml_kernel.rows16_supported()
needs_vnni = pytest.mark.skipif(not VNNI, reason="ggml::linear16 is built where the CPU has AVX-512 VNNI")
BF16 = ggml_kernel.load() and ggml_kernel.rows16_bf16_supported()
needs_bf16 = pytest.mark.skipif(not BF16, reason="ggml::linear16's BF16 form is built where the CPU has AVX512_BF16")
BF = ggml_kernel.FLOAT_TYPE_OF[torch.bfloat16]


def weight(n: int = N, k: int = K, seed: int = 5) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32))


@needs_vnni
def test_sixteen_row_groups_compute_vec_dots_products_and_each_row_alike_at_every_row_count():
    """Against ggml's vec_dot over the plain blocks (the same quantized activations, the same integer
    products; only the float sums' order differs): within 1e-6 of the sum of the products' magnitudes.
    Every row count (tiles of 1 to 8 activation rows and their remainders) gives each row's output bit
    for bit as that row alone does, in float32 and bfloat16, with a short row (K = 96: three blocks)."""
    for k in (K, 96):
        blocks = ggml_kernel.quantize(weight(k=k), "Q8_0")
        packed = ggml_kernel.pack16(blocks, Q8, N)
        assert packed.shape == blocks.shape and not torch.equal(packed, blocks)
        ref = ggml_kernel.dequantize(blocks, Q8, k)
        for rows in (1, 2, 7, 8, 9, 17, 64):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            got = torch.ops.ggml.linear16(x, packed, Q8, N)
            want = torch.ops.ggml.linear(x, blocks, Q8, N)
            bound = (x.abs() @ ref.abs().T).amax()
            assert float((got - want).abs().amax() / bound) < 1e-6, (k, rows)
            assert not torch.equal(got, torch.zeros_like(got))
            for dt in (torch.float32, torch.bfloat16):
                many = torch.ops.ggml.linear16(x.to(dt), packed, Q8, N)
                alone = torch.cat([torch.ops.ggml.linear16(x[i : i + 1].to(dt), packed, Q8, N) for i in range(rows)])
                assert many.dtype == dt and torch.equal(many, alone), (k, rows, dt)


@needs_vnni
def test_the_layout_round_trips_and_the_candidate_gathers_rows_from_it():
    """unpacked16_rows gives the plain blocks' rows back; the ggml16 kernel holds the packed blocks alone,
    is eligible against F.linear on the dequantized weight, and a tied embedding's rows read from it are
    the plain rows dequantized."""
    w = quantized(weight(), "Q8_0")
    packed = ggml_kernel.pack16(w.blocks, Q8, N)
    ids = torch.tensor([0, 15, 16, 79, 33, 33])
    assert torch.equal(ggml_kernel.unpacked16_rows(packed, ids), w.blocks.index_select(0, ids))
    pool = {c.name: c for c in candidates(torch.bfloat16, CPU)}
    kernel = check(pool["ggml16"], w, torch.bfloat16, CPU)
    assert kernel is not None and len(kernel.held) == 1
    assert kernel.storages().isdisjoint({w.blocks.untyped_storage().data_ptr()})
    assert pool["ggml16"].invariant and pool["ggml16"].twin is None  # its own sums: no twin of vec_dot
    want = ggml_kernel.dequantize(w.blocks.index_select(0, ids), Q8, K)
    assert torch.equal(kernel.gather(ids), want)


@needs_vnni
def test_the_sixteen_row_form_refuses_what_it_cannot_take():
    """Rows that are not whole groups of sixteen, or another type: not accepted, and the operator raises one
    line naming why rather than computing something else."""
    assert ggml_kernel.accepts_rows16(quantized(weight(), "Q8_0"), torch.float32, CPU)
    assert not ggml_kernel.accepts_rows16(quantized(weight(), "Q4_0"), torch.float32, CPU)
    assert not ggml_kernel.accepts_rows16(quantized(weight(n=72), "Q8_0"), torch.float32, CPU)
    odd = ggml_kernel.quantize(weight(n=72), "Q8_0")
    with pytest.raises(RuntimeError, match="whole groups of 16"):
        torch.ops.ggml.linear16(torch.randn(1, K), odd, Q8, 72)
    q4 = ggml_kernel.quantize(weight(), "Q4_0")
    with pytest.raises(RuntimeError, match="linear16 takes Q8_0"):
        torch.ops.ggml.linear16(torch.randn(1, K), q4, int(T.Q4_0), N)


@pytest.mark.skipif(VNNI, reason="this CPU has AVX-512 VNNI: the form is offered")
def test_without_avx512_vnni_the_form_is_not_offered():
    """A build without AVX-512 VNNI raises naming it, and the candidate accepts no weight (the table
    never times it)."""
    assert not ggml_kernel.accepts_rows16(quantized(weight(), "Q8_0"), torch.float32, CPU)
    with pytest.raises(RuntimeError, match="AVX-512 VNNI"):
        torch.ops.ggml.linear16(torch.randn(1, K), ggml_kernel.quantize(weight(), "Q8_0"), Q8, N)


@needs_vnni
def test_the_fake_implementation_traces():
    """The registered fake gives the shapes, so torch.compile can trace around the operator."""
    blocks = ggml_kernel.pack16(ggml_kernel.quantize(weight(), "Q8_0"), Q8, N)
    args = (torch.randn(3, K), blocks, Q8, N)
    torch.library.opcheck(torch.ops.ggml.linear16.default, args, test_utils=("test_schema", "test_faketensor"))


@needs_bf16
def test_the_bfloat16_form_sums_in_float32_and_each_row_alike_at_every_row_count():
    """Against float64 products of the bfloat16-rounded rows and weight: within 1e-6 of the sum of the
    products' magnitudes (float32 sums; tinyBLAS's are as close). Every row count gives each row's
    output bit for bit as that row alone does; float32 rows come back as float32 sums (off bfloat16's
    grid: an LM head's logits), bfloat16 rows as bfloat16."""
    w = weight(k=K).to(torch.bfloat16)
    raw = ggml_kernel.pack16_float(w)
    assert raw.dtype == torch.uint8 and raw.shape == (N, K * 2)
    for rows in (1, 2, 7, 8, 9, 17, 64):
        x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
        got = torch.ops.ggml.linear16(x, raw, BF, N)
        want = x.to(torch.bfloat16).double() @ w.double().T
        bound = x.to(torch.bfloat16).double().abs() @ w.double().abs().T
        assert got.dtype == torch.float32 and float(((got.double() - want).abs() / bound.amax()).amax()) < 1e-6
        assert (got != got.bfloat16().float()).float().mean() > 0.5
        for dt in (torch.float32, torch.bfloat16):
            many = torch.ops.ggml.linear16(x.to(dt), raw, BF, N)
            alone = torch.cat([torch.ops.ggml.linear16(x[i : i + 1].to(dt), raw, BF, N) for i in range(rows)])
            assert many.dtype == dt and torch.equal(many, alone), (rows, dt)


@needs_bf16
def test_a_tied_bfloat16_head_on_the_sixteen_row_form_holds_the_table_once():
    """The LM head of a bfloat16 model on ggml16-bf16 holds the packed weight only; the tied embedding
    reads its rows from it (the table's own values), and the head returns float32 logits."""
    w = weight(n=96, k=64).to(torch.bfloat16)
    linears = Linears(CPU, torch.bfloat16, "none", max_rows=2, max_logit_rows=2, timer=lambda: 0.0)
    linears.pool = {"ggml16-bf16": linears.pool["ggml16-bf16"]}
    head = linears.head(w)
    embed = linears.embedding(w)
    ids = torch.tensor([0, 15, 16, 95, 16])
    assert torch.equal(embed(ids), w[ids].float())
    assert linears.weight_bytes == w.numel() * 2  # the packed bfloat16 weight, once
    logits = head(torch.randn(2, 64))
    assert logits.dtype == torch.float32 and logits.shape == (2, 96)


@needs_bf16
def test_the_bfloat16_form_refuses_what_it_cannot_take():
    """Rows that are not whole groups of sixteen, a row length not a multiple of 4, or a float32 compute
    dtype: not accepted, and the operator raises one line naming why."""
    assert ggml_kernel.accepts_rows16_float(weight(), torch.bfloat16, CPU)
    assert not ggml_kernel.accepts_rows16_float(weight(), torch.float32, CPU)
    assert not ggml_kernel.accepts_rows16_float(weight(n=72), torch.bfloat16, CPU)
    assert not ggml_kernel.accepts_rows16_float(weight(k=510), torch.bfloat16, CPU)
    odd = weight(n=72).to(torch.bfloat16).view(torch.uint8)
    with pytest.raises(RuntimeError, match="whole groups of 16"):
        torch.ops.ggml.linear16(torch.randn(1, K), odd, BF, 72)


@pytest.mark.skipif(BF16, reason="this CPU has AVX512_BF16: the bfloat16 form is offered")
def test_without_avx512_bf16_the_bfloat16_form_is_not_offered():
    """A build without AVX512_BF16 raises naming it, and the candidate accepts no weight."""
    assert not ggml_kernel.accepts_rows16_float(weight(), torch.bfloat16, CPU)
    with pytest.raises(RuntimeError, match="AVX512_BF16"):
        torch.ops.ggml.linear16(torch.randn(1, K), weight().to(torch.bfloat16).view(torch.uint8), BF, N)
