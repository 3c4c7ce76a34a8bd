"""The KV cache's blocks: allocation, sharing and automatic prefix caching. Pure logic, no torch.

The cache is ``num_blocks`` blocks of ``block_size`` token slots (:class:`worker.attention.KVCache`).
A sequence owns a block table (its blocks in order). A *full* block whose keys and values have been
computed is registered under a hash chained over token ids — ``h_i = blake2b(h_{i-1} ‖ ids of
block i)``, as vLLM's and nano-vllm's prefix caches do (never Python's ``hash()``, which is salted
per process and collides by construction) — so a later sequence with the same leading tokens takes
those blocks instead of recomputing them.

A block's ``refs`` counts the sequences using it. A block no sequence uses goes to the free list,
oldest first; if it holds a registered hash it stays findable until it is handed out again, which
is LRU eviction. A finished sequence frees its blocks tail first, so its prefix, the part most
likely shared, is evicted last.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field


def block_hash(parent: bytes, token_ids: Seq[int]) -> bytes:
    """The chained hash of one full block: blake2b-128 of the parent's hash and the block's ids."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(b"".join(t.to_bytes(4, "little") for t in token_ids))
    return h.digest()


@dataclass
class Block:
    id: int
    refs: int = 0
    hash: bytes | None = None


@dataclass
class BlockTable:
    """A sequence's blocks. ``hashes[i]`` is the chained hash of its full block ``i`` (once computed)."""

    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)


class BlockManager:
    """Hands out blocks; counts prefix-cache hits.

    ``hit_tokens`` / ``queried_tokens`` count, over all admissions, the prompt tokens found cached
    and the prompt tokens looked up.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token (got {num_blocks} x {block_size})")
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # LRU first
        self.cached: dict[bytes, int] = {}
        self.hit_tokens = 0
        self.queried_tokens = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks no sequence uses (cached or blank): what an allocation can take."""
        return len(self.free)

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` tokens."""
        return -(-tokens // self.block_size)

    def _prefix_hits(self, token_ids: Seq[int]) -> tuple[list[int], list[bytes]]:
        """Cached blocks matching the leading full blocks of ``token_ids``, and their hashes. At least
        one token is always left to compute (its logits give the next token), so a prompt that is all
        cached blocks leaves its last block out."""
        bs, parent = self.block_size, b""
        hits, hashes = [], []
        for i in range((len(token_ids) - 1) // bs):
            parent = block_hash(parent, token_ids[i * bs : (i + 1) * bs])
            block = self.cached.get(parent)
            if block is None:
                break
            hits.append(block)
            hashes.append(parent)
        return hits, hashes

    def can_allocate(self, token_ids: Seq[int], reserve: int = 0, use_cache: bool = True) -> bool:
        """Whether :meth:`allocate` would succeed with ``reserve`` free blocks left over."""
        hits, _ = self._prefix_hits(token_ids) if use_cache else ([], [])
        taken = sum(1 for b in hits if self.blocks[b].refs == 0)  # cached but free: allocating takes them off the list
        need = self.blocks_for(len(token_ids)) - len(hits)
        return self.num_free - taken - need >= reserve

    def allocate(self, token_ids: Seq[int], use_cache: bool = True) -> tuple[BlockTable, int]:
        """Blocks for a sequence whose tokens so far are ``token_ids``. Returns the table and how many
        leading tokens are already computed (prefix-cache hits; none with ``use_cache=False``, for a
        sequence that must compute every position). Raises ``MemoryError`` when the free list cannot
        cover it (call :meth:`can_allocate` first)."""
        if not self.can_allocate(token_ids, use_cache=use_cache):
            raise MemoryError(f"{self.blocks_for(len(token_ids))} blocks needed, {self.num_free} free")
        hits, hashes = self._prefix_hits(token_ids) if use_cache else ([], [])
        for b in hits:
            self._take(b)
        table = BlockTable(blocks=list(hits), hashes=list(hashes))
        for _ in range(self.blocks_for(len(token_ids)) - len(hits)):
            table.blocks.append(self._take_free())
        cached = len(hits) * self.block_size
        self.hit_tokens += cached
        self.queried_tokens += len(token_ids)
        return table, cached

    def grow(self, table: BlockTable, tokens: int) -> bool:
        """Make ``table`` hold ``tokens`` tokens. False (and nothing taken) when too few blocks are free."""
        need = self.blocks_for(tokens) - len(table.blocks)
        if need > self.num_free:
            return False
        for _ in range(need):
            table.blocks.append(self._take_free())
        return True

    def register(self, table: BlockTable, token_ids: Seq[int], computed: int) -> None:
        """Register every full block of ``table`` whose ``computed`` leading tokens now have their
        keys and values in the cache, so later sequences can share them."""
        bs = self.block_size
        for i in range(len(table.hashes), computed // bs):
            parent = table.hashes[-1] if table.hashes else b""
            h = block_hash(parent, token_ids[i * bs : (i + 1) * bs])
            table.hashes.append(h)
            block = self.blocks[table.blocks[i]]
            if h not in self.cached and block.hash is None:
                block.hash = h
                self.cached[h] = block.id

    def release(self, table: BlockTable) -> None:
        """Drop one sequence's hold on its blocks, tail first (see the module docstring)."""
        for b in reversed(table.blocks):
            block = self.blocks[b]
            block.refs -= 1
            if block.refs == 0:
                self.free[b] = None
        table.blocks.clear()
        table.hashes.clear()

    def reset_prefix_cache(self) -> None:
        """Forget every registered hash (blocks in use stay allocated)."""
        for b in self.cached.values():
            self.blocks[b].hash = None
        self.cached.clear()

    def _take(self, b: int) -> None:
        block = self.blocks[b]
        if block.refs == 0:
            del self.free[b]
        block.refs += 1

    def _take_free(self) -> int:
        b, _ = self.free.popitem(last=False)
        block = self.blocks[b]
        if block.hash is not None:  # evict: it is about to hold other tokens
            del self.cached[block.hash]
            block.hash = None
        block.refs = 1
        return b
