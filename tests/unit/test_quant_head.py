"""The LM head's kernels and the tied embedding table, on random tensors in process.

A float32 model's head may run bfloat16 activations only where the products are summed in float32
(``int8group-bf16`` for a grouped int8 table such as GGUF's Q8_0, ``int8split-bf16`` for int8 rows
quantized at load, ``int4split-bf16`` for a 4-bit table): those match ``F.linear`` on the dequantized weight within ``TOL_BF16_SUM`` of the
bound and their logits are not on bfloat16's grid. A tied table whose head kernel re-lays it out is
held once: the embedding reads its rows from the kernel's layout.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.quant.autotune import storage_key
from worker.quant.format import quantize_int4, quantize_int8
from worker.quant.kernels import TOL_BF16_SUM, Kernel, candidates, check, full_precision
from worker.quant.linear import Linears

CPU = torch.device("cpu")
HEAD_KERNELS = {"int8/g32": "int8group-bf16", "int8/channel": "int8split-bf16", "int4/g32": "int4split-bf16"}


class StillClock:
    """A clock that never moves: every candidate times the same, the pool decides."""

    def time(self) -> float:
        return 0.0


def table(v: int = 320, k: int = 192) -> torch.Tensor:
    return torch.randn(v, k, generator=torch.Generator().manual_seed(3)) * 0.05


def quantized(fmt: str, w: torch.Tensor):
    if fmt == "int4/g32":
        return quantize_int4(w, 32)
    return quantize_int8(w, 32 if fmt == "int8/g32" else w.shape[1])


@pytest.mark.skipif(
    not hasattr(torch.ops.aten, "_weight_int8pack_mm") or not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"),
    reason="no weight-only ops here",
)
@pytest.mark.parametrize("fmt", list(HEAD_KERNELS))
def test_bfloat16_summed_head_kernels_match_f_linear_and_leave_the_bfloat16_grid(fmt):
    """Tolerance: TOL_BF16_SUM (6e-3) of max(|x| @ |W|.T): bfloat16 activations, scales and
    products, three roundings of 2^-9 at worst."""
    qw = quantized(fmt, table())
    name = HEAD_KERNELS[fmt]
    cand = next(c for c in candidates(torch.float32, CPU) if c.name == name)
    assert cand.tolerance == TOL_BF16_SUM and full_precision(cand, torch.float32)
    kernel = check(cand, qw, torch.float32, CPU)
    assert kernel is not None
    ref = qw.dequantize()
    x = torch.randn(8, ref.shape[1], generator=torch.Generator().manual_seed(4)) * 3
    got = kernel.fn(x)
    assert got.dtype == torch.float32 and got.shape == (8, ref.shape[0])
    bound = F.linear(x.abs(), ref.abs()).amax()
    assert (got - F.linear(x, ref)).abs().amax() <= TOL_BF16_SUM * bound
    assert (got != got.bfloat16().float()).float().mean() > 0.5  # float32 sums, not bfloat16 steps


def test_bfloat16_output_kernels_stay_off_a_float32_head():
    names = {c.name for c in candidates(torch.float32, CPU) if full_precision(c, torch.float32)}
    assert {"int8group-bf16", "int8split-bf16", "int4split-bf16", "int8group-f32", "int8pack-f32"} <= names
    assert not names & {"int8pack-bf16", "int4pack-bf16", "float-copy-bf16", "dynquant4"}


def linears_running(name: str, quantization: str = "none") -> Linears:
    linears = Linears(CPU, torch.float32, quantization, max_rows=2, max_logit_rows=2, timer=StillClock().time)
    linears.pool = {name: linears.pool[name]}
    return linears


@pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int8pack_mm"), reason="no _weight_int8pack_mm here")
def test_a_tied_q8_0_table_is_held_once_and_its_rows_read_from_the_head_layout():
    qw = quantize_int8(table(), 32)
    linears = linears_running("int8group-bf16")
    head = linears.head(qw)
    embed = linears.embedding(qw)
    ids = torch.tensor([0, 5, 5, 319])
    assert torch.equal(embed(ids), qw.dequantize()[ids])
    assert head(torch.randn(2, 192)).shape == (2, 320)
    v, k = qw.shape
    # int8 values once, the scales as float32 (the file's) and bfloat16 (the kernel's)
    assert linears.weight_bytes == v * k + v * (k // 32) * (4 + 2)


@pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int8pack_mm"), reason="no _weight_int8pack_mm here")
def test_int8_at_load_ties_the_split_head_and_the_embedding_to_one_copy():
    w = table()
    linears = linears_running("int8split-bf16", "int8")
    linears.head(w)
    embed = linears.embedding(w)
    assert linears.rows8 == {} and storage_key(w) in linears.gathers
    ids = torch.tensor([1, 2, 319])
    assert torch.equal(embed(ids), quantize_int8(w, w.shape[1]).dequantize()[ids])
    v, k = w.shape
    assert linears.weight_bytes == v * k + v * 4 + v * (k // 64) * 2  # int8 once; f32 row scales; bf16 chunk scales


def test_an_untied_table_is_quantized_on_its_own():
    head_w, table_w = table(), table() + 1
    linears = linears_running("int8split-bf16", "int8")
    linears.head(head_w)
    embed = linears.embedding(table_w)
    ids = torch.tensor([7])
    assert torch.equal(embed(ids), quantize_int8(table_w, 192).dequantize()[ids])
    assert linears.rows8 == {}


def test_tensor_parallel_ranks_run_rank_0s_kernels_whatever_they_measured():
    """A follower's own measurement is replaced by rank 0's picks (indices into the pool's sorted
    names, as :meth:`worker.tp.TPGroup.rank0_ints` carries them), built here where it had not."""
    qw = quantize_int8(table(), 192)
    sent = []

    def rank0(mine: list[int]) -> list[int]:
        sent.append(mine)
        names = sorted(linears.pool)
        return [names.index("dequant-f32"), names.index("int8pack-f32")]

    linears = Linears(CPU, torch.float32, "none", max_rows=2, timer=StillClock().time, agree=rank0)
    linears.pool = {n: c for n, c in linears.pool.items() if n in ("dequant-f32", "int8pack-f32", "int8split-bf16")}
    run = linears(qw)
    (choice,) = [c for c, _ in linears.table()]
    assert [p.kernel for p in choice.picks] == ["dequant-f32", "int8pack-f32"] and len(sent[0]) == 2
    x = torch.randn(2, 192)
    assert torch.allclose(run(x), F.linear(x, qw.dequantize()), atol=1e-4)
    linears(quantize_int8(table() + 1, 192))  # the same shape again: rank 0's choice reused, no second collective
    assert len(sent) == 1


def test_a_second_copy_must_save_a_tenth_of_the_table_per_copy_it_adds():
    """The float32 case on the AVX2 EPYC: a plain copy 30% faster at one row only, 4% of the
    table's time: dropped; the same saving by a form that adds a hundredth of the bytes: kept."""
    from worker.quant.autotune import Pick, choose

    rows = [1, 2, 4, 8, 16]
    times = {
        "packed": {1: 0.10, 2: 0.10, 4: 0.13, 8: 0.19, 16: 0.31},
        "plain": {1: 0.07, 2: 0.12, 4: 0.18, 8: 0.30, 16: 0.35},
    }
    packed = Kernel("packed", None, (torch.zeros(100),))
    copy = Kernel("plain", None, (torch.zeros(100),))
    assert choose([packed, copy], times, rows) == [Pick(r, "packed", times["packed"][r]) for r in rows]
    scales = Kernel("plain", None, (packed.held[0], torch.zeros(1)))
    assert choose([packed, scales], times, rows)[0] == Pick(1, "plain", 0.07)


def test_a_quantized_weight_holds_its_values_once_however_fast_a_second_layout():
    """int8pack-f32 on the weight's own values beside int8split-bf16's re-laid copy: with
    max_added (a quantized weight) the second layout is dropped even where it is far faster; a
    bfloat16 copy of the scales (a small addition) may stay."""
    from worker.quant.autotune import MAX_ADDED_QUANTIZED, Pick, choose

    rows = [1, 2, 4]
    times = {"own": {1: 1.0, 2: 1.0, 4: 1.0}, "relaid": {1: 2.0, 2: 2.0, 4: 0.1}}
    q, scale = torch.zeros(1000, dtype=torch.int8), torch.zeros(10)
    own = Kernel("own", None, (q, scale))
    relaid = Kernel("relaid", None, (torch.zeros(1000, dtype=torch.int8), scale))
    assert choose([own, relaid], times, rows)[2] == Pick(4, "relaid", 0.1)
    assert [p.kernel for p in choose([own, relaid], times, rows, MAX_ADDED_QUANTIZED)] == ["own"] * 3
    scales_only = Kernel("relaid", None, (q, torch.zeros(10, dtype=torch.bfloat16)))
    assert choose([own, scales_only], times, rows, MAX_ADDED_QUANTIZED)[2] == Pick(4, "relaid", 0.1)
