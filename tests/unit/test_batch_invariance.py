"""Batch invariance of each operator a step runs (``workers.deterministic``), compared bit for bit:
the attention (a decode row alone, beside others, as a prompt token of a prefill, of a chunked
prefill), the RMSNorm, and each linear kernel the deterministic table keeps (1 … max_num_seqs rows
and prefill-sized calls). The attention is checked twice: the compiled operator
(``paged_attention``, worker/step/attention.h) and the torch form a set-up without a compiler runs
(:func:`worker.attention.attend_invariant`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker import attention
from worker.attention import SPLIT, KVCache, attend_kv, build_batch
from worker.llama import rms_norm_cpu
from worker.quant import invariance
from worker.quant.autotune import tune
from worker.quant.format import quantize_int4, quantize_int8
from worker.quant.kernels import Kernel

CPU = torch.device("cpu")
BS, KVH, G, D = 16, 3, 3, 64
H = KVH * G


@pytest.fixture(params=["compiled", "torch"])
def implementation(request, monkeypatch):
    """Each attention test runs against the compiled operator and against the torch fallback."""
    if request.param == "torch":
        monkeypatch.setattr(attention, "paged_ops", lambda device: None)
    else:
        assert attention.paged_ops(CPU) is not None, "the compiled operators did not build (see the log)"
    return request.param


def _write_and_attend(cache, q, k, v, decode, prefill):
    batch = build_batch(BS, CPU, decode, prefill)
    kv = torch.stack([k, v], dim=1)  # [T, 2, KVH, D]
    return attend_kv(q, kv, cache, 0, batch, D**-0.5, invariant=True)


def _stream(length: int, dt: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(length, *shape, generator=g).to(dt) for shape in ((H, D), (KVH, D), (KVH, D))]


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_a_tokens_attention_is_the_same_decoded_alone_batched_prefilled_or_chunked(dt, implementation):
    n = 3 * SPLIT + 5  # more than one split, the last one partial
    q, k, v = _stream(n, dt, 0)
    table = list(range(-(-n // BS)))
    want = []  # token t's output decoded alone: its keys written one step at a time
    cache = KVCache(1, 64, BS, KVH, D, dt, CPU)
    for t in range(n):
        want.append(_write_and_attend(cache, q[t : t + 1], k[t : t + 1], v[t : t + 1], [(table, t + 1)], []))
    want = torch.cat(want)
    cache = KVCache(1, 64, BS, KVH, D, dt, CPU)
    whole = _write_and_attend(cache, q, k, v, [], [(table, 0, n)])
    assert torch.equal(whole, want)  # the prefill that rebuilds a migrated sequence's cache
    for size in (1, 7, 37, SPLIT, SPLIT + 1, 150):
        cache = KVCache(1, 64, BS, KVH, D, dt, CPU)
        chunks = []
        for start in range(0, n, size):
            end = min(n, start + size)
            chunks.append(_write_and_attend(cache, q[start:end], k[start:end], v[start:end], [], [(table, start, end)]))
        assert torch.equal(torch.cat(chunks), want), f"chunks of {size}"
    # the last token decoded beside 7 other sequences of other lengths and a prefill chunk
    others = [_stream(length, dt, 10 + i) for i, length in enumerate((5, 300, 17, 64, 129, 2, 250, 40))]
    cache = KVCache(1, 128, BS, KVH, D, dt, CPU)
    _write_and_attend(cache, q[: n - 1], k[: n - 1], v[: n - 1], [], [(table, 0, n - 1)])
    first, tables, decode, rows = len(table), [], [(table, n)], [(q[n - 1 :], k[n - 1 :], v[n - 1 :])]
    for (oq, ok, ov), length in zip(others[:7], (5, 300, 17, 64, 129, 2, 250), strict=True):
        tables.append(list(range(first, first + -(-length // BS))))
        first += len(tables[-1])
        _write_and_attend(cache, oq[:-1], ok[:-1], ov[:-1], [], [(tables[-1], 0, length - 1)])
        decode.append((tables[-1], length))
        rows.append((oq[-1:], ok[-1:], ov[-1:]))
    doc = others[7]
    doc_table = list(range(first, first + 3))
    _write_and_attend(cache, doc[0][:20], doc[1][:20], doc[2][:20], [], [(doc_table, 0, 20)])
    rows.append((doc[0][20:], doc[1][20:], doc[2][20:]))
    q8, k8, v8 = (torch.cat(parts) for parts in zip(*rows, strict=True))
    mixed = _write_and_attend(cache, q8, k8, v8, decode, [(doc_table, 20, 40)])
    assert torch.equal(mixed[:1], want[n - 1 :])


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_decode_rows_are_the_same_alone_and_in_batches_of_one_to_eight(dt, implementation):
    lengths = (1, 63, 64, 65, 200, 9, 130, 17)  # mixed contexts: split edges, one key, the longest first
    cache = KVCache(1, 128, BS, KVH, D, dt, CPU)
    seqs, tables, first = [], [], 0
    for i, length in enumerate(lengths):
        seqs.append(_stream(length, dt, 20 + i))
        tables.append(list(range(first, first + -(-length // BS))))
        first += len(tables[-1])
        q, k, v = seqs[-1]
        if length > 1:
            _write_and_attend(cache, q[:-1], k[:-1], v[:-1], [], [(tables[-1], 0, length - 1)])
    last = [tuple(t[-1:] for t in s) for s in seqs]  # each sequence's decode token: q, k, v [1, ...]
    alone = [_write_and_attend(cache, *last[i], [(tables[i], n)], []) for i, n in enumerate(lengths)]
    for rows in range(1, 9):
        for start in (0, 8 - rows):
            pick = range(start, start + rows)
            q, k, v = (torch.cat([last[i][j] for i in pick]) for j in range(3))
            got = _write_and_attend(cache, q, k, v, [(tables[i], lengths[i]) for i in pick], [])
            assert torch.equal(got, torch.cat([alone[i] for i in pick])), f"rows {list(pick)}"


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_attention_close_to_sdpa(dt, implementation):
    """The invariant attention computes attention: SDPA's result (in float32 from the same inputs)
    within float32 rounding, or bfloat16's rounding of the output."""
    n = 200
    q, k, v = _stream(n, dt, 3)
    cache = KVCache(1, 64, BS, KVH, D, dt, CPU)
    table = list(range(-(-n // BS)))
    got = _write_and_attend(cache, q, k, v, [], [(table, 0, n)]).view(n, KVH, G, D)
    q, k, v = (t.float().transpose(0, 1)[None] for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)[0].transpose(0, 1)
    tol = {"atol": 1e-5, "rtol": 1e-4} if dt == torch.float32 else {"atol": 8e-3, "rtol": 8e-3}
    torch.testing.assert_close(got.reshape(n, H, D).float(), ref, **tol)


def test_rms_norm_rows_do_not_see_each_other():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(300, 576, generator=g), torch.rand(576, generator=g)
    alone = torch.cat([rms_norm_cpu(x[i : i + 1], w, 1e-5) for i in range(300)])
    for rows in (1, 2, 3, 8, 17, 64, 300):
        assert torch.equal(rms_norm_cpu(x[:rows], w, 1e-5), alone[:rows])
        assert torch.equal(F.rms_norm(x[:rows], (576,), w, 1e-5), alone[:rows])


WEIGHTS = {
    "float": lambda w: w,
    "int8": lambda w: quantize_int8(w, w.shape[1]),
    "Q8_0-like": lambda w: quantize_int8(w, 32),
    "Q4_1-like": lambda w: quantize_int4(w, 32),
}


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", list(WEIGHTS))
@pytest.mark.parametrize("k", [576, 1536])
def test_the_deterministic_table_runs_one_row_invariant_kernel_per_weight(dt, kind, k):
    g = torch.Generator().manual_seed(k)
    w = WEIGHTS[kind](torch.randn(320, k, generator=g) * 0.05)
    rows = [1, 2, 4, 8]
    choice, built = tune(w, dt, CPU, rows, pool=_pool(dt), deterministic=True)
    assert len(choice.kernels()) == 1
    kernel = built[choice.kernels()[0]]
    x = torch.randn(300, k, generator=g).to(dt)
    with torch.inference_mode():
        alone = torch.cat([kernel.fn(x[i : i + 1]) for i in range(300)])
        for count in range(1, 9):  # 1 … max_num_seqs
            assert torch.equal(kernel.fn(x[:count]), alone[:count])
        for count in (16, 31, 100, 300):  # prefill chunks
            assert torch.equal(kernel.fn(x[:count]), alone[:count])


def _pool(dt):
    from worker.quant.kernels import candidates

    return candidates(dt, CPU) + invariance.candidates(dt, CPU)


def test_a_kernel_that_depends_on_the_row_count_is_dropped():
    weight = torch.randn(8, 64)

    def fn(x):  # adds a row-count-dependent term: what a kernel switching paths does
        return F.linear(x, weight) + (x.shape[0] > 4) * 1e-3

    assert invariance.row_invariant(Kernel("fake", fn, (weight,)), 64, torch.float32, CPU) is False
    rowwise = invariance.candidates(torch.float32, CPU)[0].build(weight, torch.float32)
    assert invariance.row_invariant(rowwise, 64, torch.float32, CPU) is True  # by construction
    declared = Kernel("declared", fn, (weight,))
    declared.row_invariant = True  # invariant by construction: not checked
    assert invariance.row_invariant(declared, 64, torch.float32, CPU) is True


def test_a_quantized_weight_falls_back_on_rowwise_without_a_float_copy():
    g = torch.Generator().manual_seed(7)
    w = quantize_int8(torch.randn(48, 64, generator=g) * 0.05, 64)
    pool = invariance.candidates(torch.float32, CPU)
    _, built = tune(w, torch.float32, CPU, [1, 2, 4], pool=pool, deterministic=True)
    assert set(built) == {"rowwise-dequant"}  # rowwise-copy holds a float copy: left out (quantization is for memory)
    kernel = built["rowwise-dequant"]
    assert not any(t.is_floating_point() and t.shape == (48, 64) for t in kernel.held)  # no float weight held
    copy = next(c for c in pool if c.name == "rowwise-copy").build(w, torch.float32)
    x = torch.randn(9, 64, generator=g)
    with torch.inference_mode():
        assert torch.equal(kernel.fn(x), copy.fn(x))  # the same values as the copy would give
        assert torch.equal(kernel.fn(x[:3]), kernel.fn(x)[:3])
    allowed, _ = tune(w, torch.float32, CPU, [1, 2, 4], allow_copies=True, pool=pool, deterministic=True)
    assert set(allowed.eligible) == {"rowwise-dequant", "rowwise-copy"}
