"""Decode attention's shortcuts (a view of consecutive slots, no mask when no row is padded) give
what plain softmax attention over each row's own keys gives."""

from __future__ import annotations

import torch

from worker.attention import KVCache, attend, build_batch

BLOCK, KVH, H, D = 4, 2, 4, 8


def reference(q: torch.Tensor, kv: torch.Tensor, slots: list[int], scale: float) -> torch.Tensor:
    """One query row [H, D] over the keys/values at ``slots``: softmax(q·kᵀ·scale)·v, in float64."""
    keys = kv[slots, 0].double().repeat_interleave(H // KVH, dim=1)  # [L, H, D]
    values = kv[slots, 1].double().repeat_interleave(H // KVH, dim=1)
    weights = torch.einsum("hd,lhd->hl", q.double(), keys).mul(scale).softmax(-1)
    return torch.einsum("hl,lhd->hd", weights, values).reshape(-1).float()


def run(decode: list[tuple[list[int], int]]) -> tuple[torch.Tensor, torch.Tensor, KVCache, object]:
    torch.manual_seed(0)
    cache = KVCache(1, 8, BLOCK, KVH, D, torch.float32, torch.device("cpu"))
    cache.layers[0].normal_()
    batch = build_batch(BLOCK, torch.device("cpu"), decode, [])
    q = torch.randn(len(decode), H, D)
    k, v = torch.randn(len(decode), KVH, D), torch.randn(len(decode), KVH, D)
    return attend(q, k, v, cache, 0, batch, D**-0.5), q, cache, batch


def slots_of(table: list[int], n: int) -> list[int]:
    return [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)]


def test_one_row_over_consecutive_blocks_reads_a_view_and_matches():
    out, q, cache, batch = run([([2, 3, 4], 10)])
    assert batch.decode_span == 2 * BLOCK and batch.decode_mask is None
    want = reference(q[0], cache.layers[0], slots_of([2, 3, 4], 10), D**-0.5)
    torch.testing.assert_close(out[0], want, atol=1e-5, rtol=1e-5)


def test_scattered_blocks_and_padded_rows_still_gather_and_mask():
    tables = [([5, 1, 3], 11), ([6], 3)]
    out, q, cache, batch = run(tables)
    assert batch.decode_span is None and batch.decode_mask is not None
    for row, (table, n) in enumerate(tables):
        want = reference(q[row], cache.layers[0], slots_of(table, n), D**-0.5)
        torch.testing.assert_close(out[row], want, atol=1e-5, rtol=1e-5)
