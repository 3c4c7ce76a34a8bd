"""The router's guess of which worker's prefix cache holds a prompt: cache-aware routing.

Every worker keeps a prefix cache of full KV blocks (:mod:`worker.blocks`): a prompt that starts
with a block sequence it computed recently is prefilled from the cache. The router cannot see
those caches, so it remembers what it sent: for each worker, the chained hashes of the full
blocks of the prompts it dispatched there, least recently used first out, as many as the worker's
KV cache has blocks (its LRU forgets at about the same pace), a prompt's tail before its head
(the worker frees a finished sequence tail first, so its prefix stays cached longest).
:meth:`PrefixAffinity.cached` then says how much of a new prompt a worker likely holds. SGLang's router does the same with a
radix tree of text per worker ("cache-aware load balancing"); block hashes over token ids match
what the worker's cache actually keys on.

It is a guess: a worker evicts under its own load, and a restarted one starts empty
(:meth:`forget`). A wrong guess costs a prefill, never a wrong answer.
"""

from __future__ import annotations

from collections import OrderedDict


def block_hashes(tokens: list[int], block_size: int) -> list[int]:
    """The chained hash of each full ``block_size``-token block of ``tokens`` (block i's hash
    covers blocks 0..i, as the worker's prefix cache keys them). A partial last block has none."""
    out: list[int] = []
    parent = 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, *tokens[start : start + block_size]))
        out.append(parent)
    return out


class PrefixAffinity:
    """Per worker, the block hashes of recently dispatched prompts (an LRU of ``capacity`` blocks,
    the worker's KV-cache size). Pure bookkeeping: no I/O, no locks (the router's event loop owns it)."""

    def __init__(self) -> None:
        self._blocks: dict[int, OrderedDict[int, None]] = {}
        self._shape: dict[int, tuple[int, int]] = {}  # worker id -> (block_size, capacity in blocks)

    def configure(self, worker_id: int, block_size: int, capacity_blocks: int) -> None:
        """A worker is ready with a prefix cache of ``capacity_blocks`` blocks of ``block_size``
        tokens; ``block_size`` 0 (a worker that does not say) turns affinity off for it."""
        if self._shape.get(worker_id) != (block_size, capacity_blocks):
            self._blocks.pop(worker_id, None)
        self._shape[worker_id] = (block_size, capacity_blocks)

    def forget(self, worker_id: int) -> None:
        """The worker's process changed: its cache starts empty."""
        self._blocks.pop(worker_id, None)

    def record(self, worker_id: int, prompt: list[int]) -> None:
        """``prompt`` was sent to the worker: its full blocks are (about to be) in its cache."""
        block_size, capacity = self._shape.get(worker_id, (0, 0))
        if block_size <= 0 or capacity <= 0:
            return
        held = self._blocks.setdefault(worker_id, OrderedDict())
        for h in reversed(block_hashes(prompt, block_size)):  # the head most recent: forgotten last
            held[h] = None
            held.move_to_end(h)
        while len(held) > capacity:
            held.popitem(last=False)

    def cached(self, worker_id: int, prompt: list[int]) -> tuple[float, int]:
        """``(share, blocks)``: how many of ``prompt``'s full blocks the worker likely holds as a
        prefix, and their share (0..1) of all its full blocks. Leading blocks only: the worker's
        cache reuses an unbroken prefix."""
        block_size, _ = self._shape.get(worker_id, (0, 0))
        held = self._blocks.get(worker_id)
        if block_size <= 0 or not held:
            return 0.0, 0
        hashes = block_hashes(prompt, block_size)
        matched = 0
        for h in hashes:
            if h not in held:
                break
            matched += 1
        return (matched / len(hashes) if hashes else 0.0), matched
