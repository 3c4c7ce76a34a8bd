"""The block manager: allocation, prefix-cache hits by chained hash, LRU eviction, sharing."""

from __future__ import annotations

import pytest

from worker.blocks import BlockManager, block_hash


def test_hash_chains_over_the_parent():
    a = block_hash(b"", [1, 2, 3, 4])
    assert a == block_hash(b"", [1, 2, 3, 4])
    assert block_hash(a, [5, 6, 7, 8]) != block_hash(b"", [5, 6, 7, 8])  # same ids, other prefix


def test_allocate_then_hit_after_release():
    m = BlockManager(num_blocks=8, block_size=4)
    ids = list(range(10))  # 2 full blocks + 2 tokens
    table, cached = m.allocate(ids)
    assert cached == 0 and len(table.blocks) == 3 and m.num_free == 5
    m.register(table, ids, computed=10)
    assert len(m.cached) == 2  # only full blocks are shared
    first_two = table.blocks[:2]
    m.release(table)
    assert m.num_free == 8
    again, cached = m.allocate(ids)
    assert cached == 8 and again.blocks[:2] == first_two
    assert (m.hit_tokens, m.queried_tokens) == (8, 20)


def test_last_token_is_always_computed():
    m = BlockManager(num_blocks=8, block_size=4)
    ids = list(range(8))  # exactly two full blocks
    t, _ = m.allocate(ids)
    m.register(t, ids, 8)
    m.release(t)
    _, cached = m.allocate(ids)
    assert cached == 4  # the last block is recomputed for its logits


def test_shared_blocks_are_counted_and_survive_one_release():
    m = BlockManager(num_blocks=6, block_size=4)
    sys_prompt = list(range(8))
    a, _ = m.allocate([*sys_prompt, 100, 101])
    m.register(a, [*sys_prompt, 100, 101], 10)
    b, cached = m.allocate([*sys_prompt, 200])
    assert cached == 8 and b.blocks[:2] == a.blocks[:2]
    assert m.blocks[a.blocks[0]].refs == 2
    m.release(a)
    assert m.blocks[b.blocks[0]].refs == 1 and m.num_free == 6 - 3
    m.release(b)
    assert m.num_free == 6


def test_lru_eviction_under_pressure_keeps_prefix_longest():
    m = BlockManager(num_blocks=4, block_size=2)
    old = [1, 2, 3, 4, 5]  # blocks [1,2] [3,4] + [5]
    t, _ = m.allocate(old)
    m.register(t, old, 5)
    m.release(t)  # freed tail first: [5]-block, [3,4], then [1,2] last
    new, _ = m.allocate([9] * 5)  # 3 blocks: the blank one, then the least recently freed
    assert len(m.cached) == 1  # [3,4] evicted, the prefix [1,2] still cached
    m.release(new)
    _, cached = m.allocate(old)
    assert cached == 2


def test_grow_refuses_without_taking_anything():
    m = BlockManager(num_blocks=2, block_size=2)
    t, _ = m.allocate([1, 2, 3])
    assert m.num_free == 0
    assert not m.grow(t, 5) and len(t.blocks) == 2
    with pytest.raises(MemoryError):
        m.allocate([7])


def test_can_allocate_counts_free_cached_hits_it_would_take():
    m = BlockManager(num_blocks=3, block_size=2)
    ids = [1, 2, 3, 4, 5]
    t, _ = m.allocate(ids)
    m.register(t, ids, 5)
    m.release(t)
    assert m.can_allocate(ids, reserve=0)  # 2 hits (free but cached) + 1 new = all 3 blocks
    assert not m.can_allocate(ids, reserve=1)
