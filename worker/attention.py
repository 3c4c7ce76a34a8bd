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
  grouped decode layout wins at one query token and loses at prefill lengths (the figures:
  docs/design/engine.md and the dated benchmark results).

Every query row attends to at least its own key, so no row of a softmax is empty: there is no padded
query row whose output some CUDA kernels return as NaN.

**Batch-invariant attention** (``invariant=True``, ``workers.deterministic``): SDPA's CPU kernels
reduce a row in an order that depends on how many query rows share the call, on the mask and on
the padded key count (measured: docs "Batch invariance"), so a sequence's logits would depend on
its batch, on its prompt's chunking and on whether its keys were written by decode steps or by the
prefill that rebuilds a migrated sequence's cache. :func:`attend_paged` computes every row — decode
token or prompt token alike — by one compiled operator (``paged_attention``,
worker/step/attention.h, the one the captured decode step runs): each row alone, its keys read from
its block table in position order, every sum in one fixed order (the recipe of Thinking Machines'
"Defeating Nondeterminism in LLM Inference", 2025, and vLLM's batch-invariant mode, with one split
per row). Where that operator is not built, :func:`attend_invariant` does the same in torch
operations: the row's keys in fixed-size splits of :data:`SPLIT` slots counted from position 0, each
split by a matmul of one fixed shape, the softmax's maximum over the whole row, the splits' sums
accumulated in sequence (``cumsum``). Either way the result depends on the row's query, its keys
and values only.
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
    decode_lens: torch.Tensor | None = None
    rows: tuple[torch.Tensor, torch.Tensor] | None = None  # every row's (key slots, valid): attend_invariant
    paged: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (tables, seq, lens): paged_rows

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
                decode_lens=move(self.decode_lens),
                paged=None if self.paged is None else tuple(move(t) for t in self.paged),
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
        batch.decode_lens = lens.to(device)
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
    batch.paged = paged_rows(block_size, device, decode, prefill)
    return batch


def paged_rows(
    block_size: int,
    device: torch.device,
    decode: list[tuple[list[int], int]],
    prefill: list[tuple[list[int], int, int]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every row's keys as the paged attention operator reads them (:func:`attend_paged`): ``tables``
    [N, W] block ids (one per decode row, then one per chunk; zero-padded), ``seq`` [T] the table of
    each row, ``lens`` [T] how many keys each row attends to (its position + 1: the causal limit)."""
    need = [(t, -(-n // block_size)) for t, n in decode] + [(t, -(-end // block_size)) for t, _, end in prefill]
    width = max((blocks for _, blocks in need), default=1)
    tables = [t[:blocks] + [0] * (width - blocks) for t, blocks in need]
    seq, lens = list(range(len(decode))), [n for _, n in decode]
    for i, (_, start, end) in enumerate(prefill):
        seq += [len(decode) + i] * (end - start)
        lens += range(start + 1, end + 1)
    flat = torch.tensor([*seq, *lens, *(b for t in tables for b in t)], dtype=torch.long)
    t = len(seq)
    return flat[2 * t :].view(len(tables), width).to(device), flat[:t].to(device), flat[t : 2 * t].to(device)


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
    q: torch.Tensor,
    kv_new: torch.Tensor,
    cache: KVCache,
    layer: int,
    batch: AttentionBatch,
    scale: float,
    invariant: bool = False,
) -> torch.Tensor:
    """:func:`attend` with the new keys and values already in the cache's layout, ``kv_new`` [T, 2, KVH, D]
    (a view of the fused q/k/v output: k's and v's columns follow each other): one write instead of two.
    ``invariant``: every row batch-invariant, by :func:`attend_paged` (the C++ operator the captured
    decode step runs) where it is built for ``q``'s device, else :func:`attend_invariant`; without it
    SDPA."""
    kv = cache.layers[layer]
    batch = batch.on(kv.device)
    kv.index_copy_(0, batch.slots, kv_new)
    if not invariant:
        return _attend_cached(q, kv, batch, scale)
    ops = paged_ops(kv.device)
    if ops is None:
        return attend_invariant(q, kv, batch, scale)
    return attend_paged(ops, q, kv, batch, cache.block_size, scale)


_OPS: list = []  # the fused operators' module (or None), loaded on the first CPU call


def paged_ops(device: torch.device):
    """The compiled operators (:mod:`worker.step.fused`) holding ``paged_attention`` for a CPU
    ``device``; None on other devices or where they could not be built (that log line says why)."""
    if device.type != "cpu":
        return None
    if not _OPS:
        from worker.step import fused

        _OPS.append(fused.load())
    return _OPS[0]


def attend_paged(ops, q: torch.Tensor, kv: torch.Tensor, batch: AttentionBatch, block_size: int, scale: float):
    """``q`` [T, H, D] over the keys and values of ``kv`` [S, 2, KVH, D] that ``batch.paged`` names,
    by the C++ operator ``ops.paged_attention`` (worker/step/attention.h): [T, H · D] in ``q``'s dtype,
    each row computed alone in one fixed order (batch-invariant, the same as a captured decode
    step's)."""
    if batch.paged is None:
        raise ValueError("attend_paged: the batch has no paged rows (build it with build_batch)")
    tables, seq, lens = batch.paged
    return ops.paged_attention(q, kv, tables, seq, lens, block_size, scale, q.dtype)


SPLIT = 64  # keys per split of the batch-invariant attention (a fixed size, counted from position 0)
ROW_SLOTS = 16384  # key slots gathered per pass of attend_invariant: bounds its float32 copies (~25 MiB)


def row_contexts(batch: AttentionBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's key slots [T, L] and which are its own [T, L] (bool), ``L`` the step's longest
    context rounded up to :data:`SPLIT`: decode rows first, then each chunk's tokens (the token at
    position p reads positions 0…p of its chunk's context). Padding reads slot 0, masked."""
    rows, lens = [], []
    if batch.decode_rows:
        rows.append(batch.decode_context)
        lens.append(batch.decode_lens)
    for c in batch.chunks:
        n, width = c.row1 - c.row0, c.context.shape[0]
        rows.append(c.context.expand(n, width))
        lens.append(torch.arange(width - n + 1, width + 1, device=device))
    longest = max(r.shape[1] for r in rows)
    width = -(-longest // SPLIT) * SPLIT
    slots = torch.cat([F.pad(r, (0, width - r.shape[1])) for r in rows])
    valid = torch.arange(width, device=device)[None, :] < torch.cat(lens)[:, None]
    return slots.masked_fill(~valid, 0), valid


def attend_invariant(q: torch.Tensor, kv: torch.Tensor, batch: AttentionBatch, scale: float) -> torch.Tensor:
    """``q`` [T, H, D] over its keys and values in ``kv`` [S, 2, KVH, D], every row by itself in
    fixed-size splits (module docstring): [T, H · D] in ``q``'s dtype, bit for bit the same for a
    row whatever else the step holds and however its keys were written."""
    if batch.rows is None:
        batch.rows = row_contexts(batch, kv.device)
    return attend_rows(q, kv, *batch.rows, scale)


def attend_rows(
    q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor, scale: float
) -> torch.Tensor:
    """:func:`attend_invariant`'s arithmetic over given key slots [T, L] and their validity [T, L]
    (``L`` a multiple of :data:`SPLIT`; invalid slots read slot 0 and are masked): a row's output
    does not change with ``L`` beyond its own length, since whole masked splits add exact zeros.
    The captured CUDA step calls it at its tables' full width, the eager step at the step's longest."""
    T, H, D = q.shape
    KVH = kv.shape[2]
    G, width = H // KVH, slots.shape[1]
    splits = width // SPLIT
    out = torch.empty((T, KVH, G, D), dtype=q.dtype, device=q.device)
    step = max(1, ROW_SLOTS // width)
    for r0 in range(0, T, step):
        r1 = min(T, r0 + step)
        n = r1 - r0
        ctx = kv.index_select(0, slots[r0:r1].reshape(-1)).view(n, splits, SPLIT, 2, KVH, D)
        # every product reads fresh contiguous float32 operands, [n, KVH, splits, ·, D]: BLAS takes
        # another path (and sums in another order) for a strided view of another layout
        keys = _contiguous32(ctx[:, :, :, 0].permute(0, 3, 1, 2, 4))
        values = _contiguous32(ctx[:, :, :, 1].permute(0, 3, 1, 2, 4))
        qf = _contiguous32(q[r0:r1].reshape(n, KVH, 1, G, D).expand(n, KVH, splits, G, D))
        s = torch.matmul(qf, keys.transpose(-1, -2)).mul_(scale)  # [n, KVH, splits, G, SPLIT]
        s.masked_fill_(~valid[r0:r1].view(n, 1, splits, 1, SPLIT), float("-inf"))
        p = s.sub_(s.amax(dim=(2, 4), keepdim=True)).exp_()  # the row's maximum: exact in any order
        total = p.sum(-1).cumsum(2)[:, :, -1]  # [n, KVH, G]: the splits summed in sequence
        o = torch.matmul(p, values).cumsum(2)[:, :, -1]  # [n, KVH, G, D]
        out[r0:r1] = o.div_(total.unsqueeze(-1))
    return out.view(T, H * D)


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


def _contiguous32(t: torch.Tensor) -> torch.Tensor:
    """A fresh contiguous float32 copy of ``t`` (one copy whatever its dtype and strides)."""
    return torch.empty(t.shape, dtype=torch.float32, device=t.device).copy_(t)


def _span(kv: torch.Tensor, first: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [1, KVH, L, D] of ``length`` consecutive slots from ``first``: one strided view
    each (the strides ``kv[first:first + L][None][:, :, i].transpose(1, 2)`` has, in one operation)."""
    _, _, kvh, d = kv.shape
    row = 2 * kvh * d
    size, stride = (1, kvh, length, d), (length * row, d, row, 1)
    start = kv.storage_offset() + first * row
    return kv.as_strided(size, stride, start), kv.as_strided(size, stride, start + kvh * d)
