"""Batch invariance of the linear kernels (``workers.deterministic``): which kernels give a row the
same output, bit for bit, whatever the number of rows beside it, and the kernel table's rule then.

A kernel's output for one row can depend on how many rows the call has: BLAS and oneDNN pick another
micro-kernel, blocking or reduction order by the row count (whether a kernel is row-invariant can
change with the input width on one CPU: it is checked per shape, never assumed), and a
table that runs another kernel at another bucket changes the numbers by itself. With
``deterministic`` the table (:func:`worker.quant.autotune.tune`):

- runs one row-invariant kernel, or at some buckets a declared twin of it (:func:`per_bucket`),
  the family with the least product of its times over the buckets (:func:`bucket_cost`: a bucket's
  traffic weighs by ratio); a kernel is row-invariant where :func:`row_invariant` passes —
  each row of a call of ``r`` rows, for every ``r`` of :data:`CHECK_ROWS`, equals that row computed
  alone, bit for bit (a kernel that declares ``row_invariant`` is not checked);
- runs, at each bucket, the fastest of that kernel and its declared twins that hold the same
  tensors and give its values bit for bit here (:func:`per_bucket`: ggml's ``vec_dot`` and
  llamafile's tinyBLAS compute the same Q8_0 / Q4_0 sums on an x86 CPU over the same blocks, one
  faster at a few rows, the other at many; ``ggml4``, the same sums over its own layout of the
  blocks, runs alone);
- can always fall back on :func:`candidates`' ``rowwise`` kernel (one matrix-vector product of the
  same shape per row, in one batched call: invariant by construction, slow beyond a few rows; for a
  quantized weight over its float form made per call, ``rowwise-dequant``, so no float copy is held) and,
  for a float weight wider than :data:`SPLIT_K`, ``onednn-split`` (oneDNN's prepacked linear over
  column chunks of :data:`SPLIT_K`, the products summed in float32 in chunk order; checked like any
  other).

The source of the recipe: Thinking Machines, "Defeating Nondeterminism in LLM Inference" (2025),
batch-invariant matmul; vLLM's ``VLLM_BATCH_INVARIANT`` mode.
"""

from __future__ import annotations

import logging
import math

import torch

from worker.quant.kernels import Candidate, Kernel, Weight

log = logging.getLogger(__name__)

CHECK_ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 64, 100, 128, 256)  # decode batches and prefill chunks
ALONE = 256  # rows also computed alone: a bfloat16 output hides most order changes, so many are compared
SHIFT = 9  # calls starting this many rows in
SPLIT_K = 512  # column chunk of onednn-split
# Two families whose products of times over the buckets differ by less than this factor are a tie,
# decided by the smallest bucket (per_bucket): on the 2-core Zen 4 box, four tunings of one bfloat16
# weight put two kernels' product ratio anywhere in 0.90-1.07 (one 2x faster at one row, 1.4x slower
# at 128), so the rule alone picked by the machine's noise, and a lone client's decode paid 2x there.
# Narrow, so that a real difference still goes by the product (a kernel 1.15x worse by it loses).
TIE = 1.1


def row_invariant(kernel: Kernel, k: int, dt: torch.dtype, device: torch.device) -> bool:
    """Whether ``kernel`` (for a weight [N, ``k``]) gives every row the same output, bit for bit,
    whatever the row count of the call (each of :data:`CHECK_ROWS`) and the row's place in it (the
    first :data:`ALONE` rows alone, and calls starting :data:`SHIFT` rows in), against one call of
    them all. An order change that a bfloat16 output rounds away in every compared value passes. A
    kernel that declares ``row_invariant`` (by construction, or known not to be) is not checked."""
    declared = getattr(kernel, "row_invariant", None)
    if declared is not None:
        return bool(declared)
    x = _check_rows(k, dt, device)
    with torch.inference_mode():
        full = kernel.fn(x)
        calls = [(0, rows) for rows in CHECK_ROWS] + [(i, 1) for i in range(ALONE)]
        calls += [(SHIFT, rows) for rows in CHECK_ROWS[:8]]
        for first, rows in calls:
            if not torch.equal(kernel.fn(x[first : first + rows]), full[first : first + rows]):
                log.info(
                    "kernel %s is not row-invariant for K=%d (%d rows from row %d): not used when deterministic",
                    kernel.name,
                    k,
                    rows,
                    first,
                )
                return False
    return True


def bucket_cost(times: dict[int, float], rows: list[int]) -> float:
    """How a kernel timed at ``times`` (``times[r]``: seconds per call of ``r`` rows) serves the
    buckets ``rows`` together: ``sum(log(times[r]))``, the log of the product of its times (a lower
    value, a faster kernel). A bucket the kernel was not timed at (pruned there as too slow) counts
    as infinitely slow.

    Why a product: each bucket stands for a kind of traffic — one row a lone client's decode, up to
    ``max_num_seqs`` a closed loop's, the middle ones decodes with a prefill chunk beside them, the
    largest a prompt prefilled alone (larger steps run its kernel) — and what each shows its users
    is a rate (tokens per second, time to first token) that a kernel ``x`` times slower at that
    bucket divides by ``x`` on its share. By the product, a kernel twice as slow at one bucket must
    be twice as fast at another to be picked, whichever buckets they are. The plain sum of times
    weighs buckets by their absolute time: the 128-row bucket decided, and a kernel several times
    slower on every decode step ran because it won there. Time per row summed (what a token costs
    through each bucket) errs the other way: the one-row bucket decides, and a kernel a little
    faster at one row and three times slower at prefill is picked, which a long document's time to
    first token pays. Under the product a kernel slower at the prefill buckets is still picked where
    it is faster at the decode buckets by more (the product of its gains exceeds that of its losses),
    and a long document's prefill then runs that much slower on the weight's share."""
    return sum(math.log(max(times.get(r, math.inf), 1e-12)) for r in rows)


def _check_rows(k: int, dt: torch.dtype, device: torch.device) -> torch.Tensor:
    """The random rows [max(CHECK_ROWS) + SHIFT, k] the checks of this module call kernels on."""
    g = torch.Generator(device="cpu").manual_seed(1)
    return torch.randn(max(CHECK_ROWS) + SHIFT, k, generator=g).to(device=device, dtype=dt)


def same_values(a: Kernel, b: Kernel, k: int, dt: torch.dtype, device: torch.device) -> bool:
    """Whether ``b`` may serve any bucket of a row-invariant ``a`` (both for one weight [N, ``k``]):
    ``b`` is row-invariant itself (:func:`row_invariant`) and gives ``a``'s output bit for bit on the
    check's rows in one call, so on each of them alone and in every call the check makes too."""
    x = _check_rows(k, dt, device)
    with torch.inference_mode():
        return torch.equal(a.fn(x), b.fn(x)) and row_invariant(b, k, dt, device)


def per_bucket(
    built: dict[str, Kernel], times: dict[str, dict[int, float]], rows: list[int], k: int, dt, device
) -> list[str]:
    """Each bucket's kernel (one per ``rows``) when deterministic. A row-invariant kernel
    (:func:`row_invariant`) may share the buckets with its *family*: the kernels of its twin class
    (:attr:`Kernel.twin`, set from :attr:`~worker.quant.kernels.Candidate.twin`: the same values by
    construction, as ggml's ``vec_dot``, its four-row form and llamafile's tinyBLAS on x86) that hold
    no tensor it does not hold (another layout of the weight would hold its bytes twice) and give its
    values bit for bit here (:func:`same_values`, checked once per weight shape). Each bucket runs
    the family's fastest there, and the family with the least :func:`bucket_cost` of those times is
    chosen; families whose products of times are within :data:`TIE` of the least are a tie, and of
    them the one fastest at the smallest bucket (a lone client's decode) is chosen (then by cost,
    then by name). Only declared twins: two kernels that merely agree on the checked rows
    (``F.linear`` and oneDNN's prepacked linear often do) may still part at a row count the check
    did not try. Raises ``RuntimeError`` when no kernel is row-invariant."""
    twin_class = {n: built[n].twin or n for n in built}

    def family(base: str) -> list[str]:
        """``base`` first, then its twins holding no tensor it does not hold."""
        held = built[base].storages()
        twins = [n for n in built if n != base and twin_class[n] == twin_class[base] and built[n].storages() <= held]
        return [base, *twins]

    def plan(names: list[str]) -> tuple[float, list[str]]:
        """The fastest of ``names`` at each bucket (ties: the first of them) and the cost of those times."""
        picks = [min(names, key=lambda n: (times.get(n, {}).get(r, math.inf), n != names[0], n)) for r in rows]
        return bucket_cost(
            {r: times.get(p, {}).get(r, math.inf) for r, p in zip(rows, picks, strict=True)}, rows
        ), picks

    # each family's cost were every member of it to pass the checks: a bound on what it can do
    bound = {n: plan(family(n))[0] for n in built}
    near = math.log(TIE)
    found: list[tuple[float, str, list[str]]] = []
    for base in sorted(built, key=lambda n: (bound[n], n)):
        if found and bound[base] >= min(c for c, _, _ in found) + near:
            break  # no later family can do better or tie, even if every member of it passes
        if not row_invariant(built[base], k, dt, device):
            continue
        ours = times.get(base, {})
        faster = [
            n
            for n in family(base)
            if n != base and any(times.get(n, {}).get(r, math.inf) < ours.get(r, math.inf) for r in rows)
        ]
        same = [base] + [n for n in sorted(faster) if same_values(built[base], built[n], k, dt, device)]
        if len(same) > 1:
            log.info("kernels %s give %s's values bit for bit for K=%d: mixed per bucket", same[1:], base, k)
        cost, picks = plan(same)
        found.append((cost, base, picks))
    if not found:
        raise RuntimeError(f"no row-invariant kernel for a weight with K={k} here (workers.deterministic)")
    least = min(c for c, _, _ in found)
    tied = [f for f in found if f[0] <= least + near]
    first = rows[0]
    return min(tied, key=lambda f: (times.get(f[2][0], {}).get(first, math.inf), f[0], f[1]))[2]


def candidates(dt: torch.dtype, device: torch.device) -> list[Candidate]:
    """The kernels added to the pool when deterministic, each invariant by construction:
    ``rowwise`` for a float weight; for a quantized one ``rowwise-dequant`` (its float form made per
    call, none held) and ``rowwise-copy`` (a float copy held: a :attr:`Candidate.copy`, left out
    unless copies are allowed, since quantization is for memory); and, on CPU, ``onednn-split``
    (float weights wider than :data:`SPLIT_K`, checked)."""
    tol = 1e-4 if dt == torch.float32 else 2e-2
    out = [
        Candidate("rowwise", tol, lambda w, d, dev: isinstance(w, torch.Tensor), _rowwise),
        Candidate("rowwise-dequant", tol, _quantized, _rowwise_dequant),
        Candidate("rowwise-copy", tol, _quantized, _rowwise, copy=True),
    ]
    if device.type == "cpu":
        out.append(Candidate("onednn-split", tol, _wide_float, _onednn_split))
    return out


def _float(w: Weight, dt: torch.dtype) -> torch.Tensor:
    return w.to(dt) if isinstance(w, torch.Tensor) else w.dequantize(dt)


def _rowwise(w: Weight, dt: torch.dtype) -> Kernel:
    """:func:`_per_row` over the weight's float form, held."""
    weight = _float(w, dt)
    wt = weight.t()
    kernel = Kernel("rowwise", lambda x: _per_row(x, wt), (weight,))
    kernel.row_invariant = True
    return kernel


def _per_row(x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    """``x`` [T, K] times ``wt`` [K, N] (a weight transposed) as T products of one row each, in one
    batched call (``bmm`` over the weight expanded, not copied): the same shape for every row, so
    the same sum."""
    return torch.bmm(x.unsqueeze(1), wt.expand(x.shape[0], -1, -1)).squeeze(1)


def _quantized(w: Weight, dt: torch.dtype, device: torch.device) -> bool:
    return not isinstance(w, torch.Tensor)


def _rowwise_dequant(w: Weight, dt: torch.dtype) -> Kernel:
    """:func:`_rowwise` over the weight dequantized at each call: the same values, and only the
    quantized tensors held (a transient float weight per call, one at a time)."""
    held = tuple(t for t in (w.q, w.scale, w.offset) if t is not None)
    kernel = Kernel("rowwise-dequant", lambda x: _per_row(x, w.dequantize(dt).t()), held)
    kernel.row_invariant = True
    return kernel


def _wide_float(w: Weight, dt: torch.dtype, device: torch.device) -> bool:
    return isinstance(w, torch.Tensor) and w.shape[1] > SPLIT_K


def _onednn_split(w: torch.Tensor, dt: torch.dtype) -> Kernel:
    k = w.shape[1]
    cuts = list(range(0, k, SPLIT_K))
    weight = w.to(dt)
    with torch.no_grad():
        packs = [torch.ops.mkldnn._reorder_linear_weight(weight[:, c : c + SPLIT_K].contiguous()) for c in cuts]
    op = torch.ops.mkldnn._linear_pointwise

    def fn(x: torch.Tensor) -> torch.Tensor:
        out = op(x[:, :SPLIT_K].contiguous(), packs[0], None, "none", [], "").float()
        for c, packed in zip(cuts[1:], packs[1:], strict=True):
            out += op(x[:, c : c + SPLIT_K].contiguous(), packed, None, "none", [], "")
        return out.to(x.dtype)

    return Kernel("onednn-split", fn, tuple(packs))
