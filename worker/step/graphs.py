"""The captured decode step on CUDA: one CUDA graph per batch-size bucket, as gpt-fast and vLLM do.

A graph replays fixed shapes at fixed addresses, so each bucket B owns static inputs — token ids,
positions, cache slots [B], block tables [B, W] (W: blocks of the longest sequence,
``max_model_len``), context lengths [B] — and its logits [B, V]. A step of n ≤ B decode rows copies
its inputs into them (one host-to-device copy of one packed tensor) and replays; rows n…B-1 are
copies of row 0 (:func:`pad_rows`), so the padding writes row 0's key and value to row 0's slot
again, never a slot another sequence owns. The captured forward (:func:`static_forward`) attends
over each row's whole table width with a mask from its length (gpt-fast's layout: the gathered
context is [B, W·block, …] whatever the lengths), so one graph serves every length; for a
batch-invariant model (``workers.deterministic``) with the eager step's arithmetic
(:func:`worker.attention.attend_rows`), so a row's logits do not depend on whether its step was
captured. The graphs are captured largest bucket first into one memory pool (vLLM's order: the
smaller ones reuse its blocks), after the KV cache is allocated. :func:`static_forward` runs on any device, so its
numbers are tested on CPU against the eager forward pass (``tests/integration/test_step_capture.py``).
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from worker.attention import SPLIT, attend_rows
from worker.step import plan as step_plan

log = logging.getLogger(__name__)


def pad_rows(rows: list, bucket: int) -> list:
    """``rows`` followed by copies of its first row up to ``bucket`` rows. Raises ``ValueError``
    when there are no rows or more than ``bucket``."""
    if not rows or len(rows) > bucket:
        raise ValueError(f"{len(rows)} rows do not fit a bucket of {bucket}")
    return rows + [rows[0]] * (bucket - len(rows))


def packed_inputs(rows: list[tuple[list[int], int, int]], width: int, block_size: int) -> list[int]:
    """One flat list of a bucket's inputs for decode rows ``(block_table, position, token)``:
    ids, positions, slots, lens [B] each, then the tables [B, width] (padded with block 0)."""
    flat = [tok for _, _, tok in rows]
    flat += [p for _, p, _ in rows]
    flat += [step_plan.slot_of(t, p, block_size) for t, p, _ in rows]
    flat += [p + 1 for _, p, _ in rows]
    for table, _, _ in rows:
        if len(table) > width:
            raise ValueError(f"a block table of {len(table)} blocks is wider than the graphs' {width}")
        flat += table + [0] * (width - len(table))
    return flat


def scratch_inputs(b: int, width: int, block_size: int, device: torch.device) -> torch.Tensor:
    """:func:`packed_inputs` of ``b`` rows of token 0 at position 0 in block 0, on ``device``: what a
    capture, or the measuring of its pool, runs before any sequence holds a block."""
    return torch.tensor(packed_inputs(pad_rows([([0], 0, 0)], b), width, block_size), device=device)


def unpack(t: torch.Tensor, b: int) -> tuple[torch.Tensor, ...]:
    """Views of :func:`packed_inputs`' tensor for ``b`` rows: ids, positions, slots, lens, tables."""
    return t[:b], t[b : 2 * b], t[2 * b : 3 * b], t[3 * b : 4 * b], t[4 * b :].view(b, -1)


@torch.inference_mode()
def static_forward(model, cache, packed: torch.Tensor, b: int) -> torch.Tensor:
    """A decode step of ``b`` rows of a :class:`worker.llama.LlamaModel` whose shapes depend only on
    ``b`` and the tables' width (capturable in a CUDA graph). ``packed``: :func:`packed_inputs` as a
    long tensor on the model's device. Returns float32 logits [b, V]."""
    m, bs = model, cache.block_size
    ids, positions, slots, lens, tables = unpack(packed, b)
    H, KVH, D, dt = m.heads, m.kv_heads, m.head_dim, m.dtype
    ctx = (tables[:, :, None] * bs + torch.arange(bs, device=packed.device)).view(b, -1)  # [b, L] slots
    mask = (torch.arange(ctx.shape[1], device=packed.device)[None, :] < lens[:, None])[:, None, None, :]
    cos, sin = m.cos[positions].to(dt)[:, None, :], m.sin_signed[positions].to(dt)[:, None, :]
    rows = _invariant_rows(ctx, mask[:, 0, 0]) if m.invariant else None
    x = m.embed(ids)
    for layer, kv in zip(m.layers, cache.layers, strict=True):
        qkv = layer.qkv(F.rms_norm(x, (x.shape[-1],), layer.attn_norm, m.eps).to(dt))
        if layer.qkv_bias is not None:
            qkv = qkv + layer.qkv_bias
        qk = qkv[:, : (H + KVH) * D].view(b, H + KVH, D)
        qk = qk * cos + qk.roll(D // 2, -1) * sin
        kv.index_copy_(0, slots, torch.stack((qk[:, H:], qkv[:, (H + KVH) * D :].view(b, KVH, D)), 1))
        if rows is not None:  # the eager step's batch-invariant arithmetic (worker.attention), at full width
            o = attend_rows(qk[:, :H], kv, *rows, m.scale)
        else:
            c = kv.index_select(0, ctx.reshape(-1)).view(b, -1, 2, KVH, D)
            keys, values = c[:, :, 0].transpose(1, 2), c[:, :, 1].transpose(1, 2)  # [b, KVH, L, D]
            q = qk[:, :H].reshape(b, KVH, H // KVH, D)
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=m.scale)
        x = x + layer.o(o.reshape(b, H * D)).float()
        if layer.o_bias is not None:
            x = x + layer.o_bias
        gate, up = layer.gate_up(F.rms_norm(x, (x.shape[-1],), layer.mlp_norm, m.eps).to(dt)).chunk(2, -1)
        x = x + layer.down(F.silu(gate) * up).float()
    return m.head(x)


def _invariant_rows(ctx: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Key slots and validity [b, L'] for :func:`worker.attention.attend_rows`: ``ctx`` [b, L] padded to
    whole splits, invalid slots set to slot 0 (as :func:`worker.attention.row_contexts` lays them out)."""
    pad = -ctx.shape[1] % SPLIT
    ctx, valid = F.pad(ctx, (0, pad)), F.pad(valid, (0, pad))
    return ctx.masked_fill(~valid, 0), valid


# The graphs' pool over one eager run's peak: capture allocates in a pool of its own, where a block
# freed inside one graph serves only later allocations of the graphs, and a quantized kernel's
# buffers round up (1.25 fell short for int4 on an H200: docs/benchmarks/results.md, GPU section).
POOL_MARGIN = 2.0


def pool_bytes(model, scratch, sizes: list[int], width: int) -> int:
    """Bytes the graphs of ``sizes`` will hold in their pool: the transient peak of one
    :func:`static_forward` of the largest bucket over ``scratch`` (a cache of one block on the
    model's GPU: the tables all point at block 0, the width is the graphs'), times
    :data:`POOL_MARGIN`, plus every other bucket's logits (each graph keeps its own output). The
    KV budget leaves this out, so capturing after the cache is allocated does not run out of memory
    (vLLM likewise leaves room for its graphs when sizing the cache)."""
    b, device = max(sizes), scratch.layers[0].device
    packed = scratch_inputs(b, width, scratch.block_size, device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    held = torch.cuda.memory_allocated(device)
    logits = static_forward(model, scratch, packed, b)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - held
    per_row = logits.shape[-1] * logits.element_size()
    return int(peak * POOL_MARGIN) + (sum(sizes) - b) * per_row


class GraphDecode:
    """CUDA graphs of :func:`static_forward` for each bucket of ``sizes``, over ``cache`` (on one
    GPU); ``width``: blocks per table (``max_model_len`` / block size, rounded up). Same ``forward``
    interface as :class:`worker.step.decode.FusedDecode` but taking decode rows."""

    def __init__(self, model, cache, sizes: list[int], width: int):
        self.model, self.cache, self.sizes, self.width = model, cache, sizes, width
        self.block_size = cache.block_size
        self.device = cache.layers[0].device
        self.inputs: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def capture(self) -> None:
        """Capture every bucket, largest first, into one pool; logs how long it took. Each capture
        runs the step on a scratch input first (three times on a side stream, as torch's docs ask),
        which writes slot 0: at start-up no sequence holds a block yet."""
        start, pool = time.monotonic(), None
        for b in sorted(self.sizes, reverse=True):
            self.inputs[b] = scratch_inputs(b, self.width, self.block_size, self.device)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    static_forward(self.model, self.cache, self.inputs[b], b)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # the side stream's cached blocks: the graph's pool cannot reuse them
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = static_forward(self.model, self.cache, self.inputs[b], b)
            pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize()
        log.info("captured CUDA graphs for batch sizes %s in %.1fs", self.sizes, time.monotonic() - start)

    def forward_rows(self, rows: list[tuple[list[int], int, int]]) -> torch.Tensor:
        """Logits [n, V] (float32) of ``n`` decode rows ``(block_table, position, token)``; a view
        of the bucket's output, valid until the next replay."""
        b = step_plan.bucket_for(len(rows), self.sizes)
        # a few hundred bytes from pageable memory: a pinned buffer per step would cost more to allocate
        self.inputs[b].copy_(torch.tensor(packed_inputs(pad_rows(rows, b), self.width, self.block_size)))
        self.graphs[b].replay()
        return self.outputs[b][: len(rows)]
