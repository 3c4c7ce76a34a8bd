"""Attention over a block KV cache, in plain torch ops (CPU and GPU alike).

The cache (:class:`KVCache`) is one tensor allocated once at its budgeted size:
``[layers, slots, 2, kv_heads, head_dim]``, where slot ``b · block_size + j`` is token ``j`` of
block ``b``. A sequence's keys live in the blocks of its block table (:mod:`worker.blocks`), so
sequences share cached prefix blocks and memory never fragments or grows.

One engine step runs every scheduled token as one row of a flattened batch: first the decode rows
(one query token each), then the prefill chunks. Per layer, :func:`attend` writes the step's new
keys/values at their slots, then attends:

* decode rows as one batch: their keys are gathered to ``[B, L, ...]`` (L = longest context) and the
  query heads of each KV head are laid along SDPA's query axis (``[B, kv_heads, group, D]``), so
  grouped-query attention needs no repeated keys; padded key columns are masked (no mask at all when
  no row is padded, batch 1 always); a single row whose blocks follow each other in the cache reads
  them as a view instead of a gathered copy;
* each prefill chunk on its own: queries ``[1, heads, chunk, D]`` against its context's keys
  (SDPA's grouped-query mode) with a causal mask offset by the tokens already cached (chunked
  prefill, prefix-cache hits). Measured on CPU, each layout is the faster one for its case: the
  grouped decode layout beats ``enable_gqa`` by up to 1.8x at one query token, and loses by 7x at
  512 (docs/design/engine.md).

Every query row attends to at least its own key, so no row of a softmax is empty: there is no padded
query row whose output some CUDA kernels return as NaN.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


class KVCache:
    """All keys and values of one replica: per layer ``[num_blocks · block_size, 2, kv_heads, head_dim]``,
    on that layer's device (``devices``, one per layer; a layer-split replica spreads them).

    Allocated zeroed, once, at its budgeted size (so a CPU worker's RSS holds it from the start and
    stays flat, and a GPU worker never allocates KV memory while serving)."""

    def __init__(
        self,
        layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | list[torch.device],
    ):
        self.num_blocks, self.block_size = num_blocks, block_size
        devices = device if isinstance(device, list) else [device] * layers
        shape = (num_blocks * block_size, 2, kv_heads, head_dim)
        self.layers = [torch.zeros(shape, dtype=dtype, device=d) for d in devices]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers)


@dataclass
class Chunk:
    """One prefill chunk: rows ``[row0, row1)`` of the step; ``context`` [L] slots of all its keys
    (cached prefix + this chunk); ``mask`` [chunk, L], True = attend."""

    row0: int
    row1: int
    context: torch.Tensor
    mask: torch.Tensor


@dataclass
class AttentionBatch:
    """Where one step's rows read and write. ``slots`` [T]: where each row's key/value goes; the first
    ``decode_rows`` rows are decode tokens with ``decode_context`` [B, L] slots (padding: slot 0,
    masked by ``decode_mask`` [B, 1, 1, L], None when no row is padded; ``decode_span``: the first
    slot when there is one row whose slots are consecutive, read as a view); then the ``chunks``."""

    slots: torch.Tensor
    decode_rows: int = 0
    decode_context: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    chunks: list[Chunk] = field(default_factory=list)
    copies: dict = field(default_factory=dict)
    decode_span: int | None = None

    def on(self, device: torch.device) -> AttentionBatch:
        """This batch with its tensors on ``device`` (copied once per device per step: layer splits)."""
        if self.slots.device == device:
            return self
        if device not in self.copies:
            move = lambda t: None if t is None else t.to(device)  # noqa: E731
            self.copies[device] = AttentionBatch(
                move(self.slots),
                self.decode_rows,
                move(self.decode_context),
                move(self.decode_mask),
                [Chunk(c.row0, c.row1, move(c.context), move(c.mask)) for c in self.chunks],
                decode_span=self.decode_span,
            )
        return self.copies[device]


def build_batch(
    block_size: int,
    device: torch.device,
    decode: list[tuple[list[int], int]],
    prefill: list[tuple[list[int], int, int]],
) -> AttentionBatch:
    """Attention metadata for one step.

    ``decode``: per decode row ``(block_table, context_len)`` (its query is the token at position
    ``context_len - 1``). ``prefill``: per chunk ``(block_table, start, end)``: positions
    ``[start, end)`` are computed now, ``[0, start)`` are cached.
    Rows are numbered decode rows first, then each chunk's tokens in order.
    """
    slots: list[torch.Tensor] = []
    batch = AttentionBatch(slots=torch.empty(0))
    if decode:
        lens = torch.tensor([n for _, n in decode])  # [B]
        longest = int(lens.max())
        width = -(-longest // block_size)
        tables = torch.tensor([t[:width] + [0] * (width - len(t[:width])) for t, _ in decode])  # [B, blocks]
        pos = torch.arange(longest)
        ctx = tables[:, pos // block_size] * block_size + pos % block_size  # [B, L]
        valid = pos[None, :] < lens[:, None]
        ctx = torch.where(valid, ctx, 0)
        slots.append(ctx.gather(1, (lens - 1)[:, None])[:, 0])
        batch.decode_rows = len(decode)
        batch.decode_context = ctx.to(device)
        # all rows as long as the longest (batch 1 always): no mask, so SDPA converts none per layer
        batch.decode_mask = None if bool(valid.all()) else valid[:, None, None, :].to(device)
        batch.decode_span = _one_span(ctx)
    row = len(decode)
    for table, start, end in prefill:
        pos = torch.arange(end)
        context = torch.tensor(table[: -(-end // block_size)])[pos // block_size] * block_size + pos % block_size
        slots.append(context[start:])
        mask = pos[None, :] <= torch.arange(start, end)[:, None]  # [C, L]
        batch.chunks.append(Chunk(row, row + end - start, context.to(device), mask.to(device)))
        row += end - start
    batch.slots = torch.cat(slots).to(device) if slots else torch.empty(0, dtype=torch.long, device=device)
    return batch


def _one_span(ctx: torch.Tensor) -> int | None:
    """The first slot of a single decode row's context [1, L] when its slots are consecutive (its
    blocks follow each other in the cache), else None."""
    if ctx.shape[0] != 1:
        return None
    first = int(ctx[0, 0])
    return first if bool((ctx[0] == torch.arange(first, first + ctx.shape[1])).all()) else None


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, layer: int, batch: AttentionBatch, scale: float
) -> torch.Tensor:
    """Write ``k``, ``v`` [T, KVH, D] at ``batch.slots`` in ``layer``'s cache, then attend ``q`` [T, H, D].
    Returns [T, H · D]."""
    kv = cache.layers[layer]  # [S, 2, KVH, D]
    batch = batch.on(kv.device)
    kv[:, 0].index_copy_(0, batch.slots, k)
    kv[:, 1].index_copy_(0, batch.slots, v)
    return _attend_cached(q, kv, batch, scale)


def attend_kv(
    q: torch.Tensor, kv_new: torch.Tensor, cache: KVCache, layer: int, batch: AttentionBatch, scale: float
) -> torch.Tensor:
    """:func:`attend` with the new keys and values already in the cache's layout, ``kv_new`` [T, 2, KVH, D]
    (a view of the fused q/k/v output: k's and v's columns follow each other): one write instead of two."""
    kv = cache.layers[layer]
    batch = batch.on(kv.device)
    kv.index_copy_(0, batch.slots, kv_new)
    return _attend_cached(q, kv, batch, scale)


def _attend_cached(q: torch.Tensor, kv: torch.Tensor, batch: AttentionBatch, scale: float) -> torch.Tensor:
    """``q`` [T, H, D] over the keys and values of ``kv`` [S, 2, KVH, D] that ``batch`` names: [T, H · D]."""
    T, H, D = q.shape
    KVH = kv.shape[2]
    G = H // KVH
    qg = q.view(T, KVH, G, D)
    if batch.decode_span is not None and T == 1:  # batch 1: views of the cache in, SDPA's output out
        keys, values = _span(kv, batch.decode_span, batch.decode_context.shape[1])
        return F.scaled_dot_product_attention(qg, keys, values, scale=scale).reshape(T, H * D)
    out = torch.empty((T, KVH, G, D), dtype=q.dtype, device=q.device)
    if batch.decode_rows:
        B, L = batch.decode_context.shape
        if batch.decode_span is not None:  # one row over consecutive slots: a view, no copy of the context
            keys, values = _span(kv, batch.decode_span, L)
        else:
            ctx = kv.index_select(0, batch.decode_context.view(-1)).view(B, L, 2, KVH, D)
            keys, values = ctx[:, :, 0].transpose(1, 2), ctx[:, :, 1].transpose(1, 2)  # [B, KVH, L, D]
        o = F.scaled_dot_product_attention(qg[:B], keys, values, attn_mask=batch.decode_mask, scale=scale)
        out[:B] = o  # [B, KVH, G, D]
    for c in batch.chunks:
        ctx = kv.index_select(0, c.context)  # [L, 2, KVH, D]
        keys, values = ctx[None, :, 0].transpose(1, 2), ctx[None, :, 1].transpose(1, 2)  # [1, KVH, L, D]
        qc = q[c.row0 : c.row1].transpose(0, 1)[None]  # [1, H, C, D]
        o = F.scaled_dot_product_attention(qc, keys, values, attn_mask=c.mask, scale=scale, enable_gqa=True)
        out[c.row0 : c.row1] = o[0].transpose(0, 1).view(-1, KVH, G, D)
    return out.view(T, H * D)


def _span(kv: torch.Tensor, first: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [1, KVH, L, D] of ``length`` consecutive slots from ``first``: one strided view
    each (the strides ``kv[first:first + L][None][:, :, i].transpose(1, 2)`` has, in one operation)."""
    _, _, kvh, d = kv.shape
    row = 2 * kvh * d
    size, stride = (1, kvh, length, d), (length * row, d, row, 1)
    start = kv.storage_offset() + first * row
    return kv.as_strided(size, stride, start), kv.as_strided(size, stride, start + kvh * d)
