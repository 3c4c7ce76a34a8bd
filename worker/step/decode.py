"""The captured decode step on CPU: a decode-only step of a :class:`worker.llama.LlamaModel` run
through the fused operators of :mod:`worker.step.fused`, with every per-step decision made once
per batch size.

Eager, one layer of a batch-1 decode step is ~40 dispatched tensor operations (RMSNorm's six, RoPE's
four, casts, views, SDPA's set-up for one query row, SiLU·up's) and the Python between them; on a
small model that dispatch is a large part of the step (profiled: the dated benchmark results). Here a layer is nine calls:
the fused q/k/v linear, RoPE writing k and v into the cache and returning q, attention over the
row's block table, o_proj, its output added into the float32 residual and the MLP's RMSNorm in one
call, gate/up, SiLU·up writing down_proj's input dtype, down_proj, and its residual add with the
next layer's attention RMSNorm in one call (written in that linear's input dtype). The linears are opaque
calls: the kernel table's own callables (:mod:`worker.quant.linear`), the form without casts
(``native``) where the model computes in float32, as the eager step uses them. The kernel each
linear runs, and that form, are resolved once per batch size (:meth:`FusedDecode.layers`): the
CPU's counterpart of capturing a CUDA graph per bucket.

Each fused operator computes a row on its own, so a row's values do not depend on what else shares
the step; RMSNorm, RoPE and SiLU·up round where the eager step rounds (its own order of operations),
the sums of RMSNorm and attention run in another order than torch's kernels (float32 logits differ
from the eager step's in their last bits; greedy tokens are the same:
``tests/integration/test_step_capture.py``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from worker.step import plan as step_plan

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def unsupported(model, cache, group=None) -> str | None:
    """Why no captured step can serve ``model`` over ``cache`` (None: one can): only this engine's
    own Llama forward on one rank and one device, in a float compute dtype. Batch-invariant models
    (``workers.deterministic``) are served: the step's attention is the operator their eager steps
    run (:func:`worker.attention.attend_paged`), and so is its RMSNorm."""
    from worker.llama import LlamaModel

    if not isinstance(model, LlamaModel):
        return "the model runs transformers' forward"
    if group is not None or model.reduce is not None:
        return "tensor parallel"
    if len({t.device for t in cache.layers} | {model.device}) > 1:
        return "layers on several devices"
    if model.dtype not in _FLOATS or model.head_dim % 2:
        return f"dtype {model.dtype} / head_dim {model.head_dim}"
    return None


def _native(linear, dt: torch.dtype) -> Callable[[int], tuple[torch.dtype, Callable]]:
    """``rows -> (input dtype, fn)`` for one linear: its kernel without casts where the model is
    float32 (as the eager step runs o, gate/up and down there), else the callable as it is."""
    if dt != torch.float32 or not hasattr(linear, "native"):
        return lambda rows: (dt, linear)

    def pick(rows: int) -> tuple[torch.dtype, Callable]:
        act, fn = linear.native(rows)
        return (dt, linear) if act is None else (act, fn)

    return pick


class FusedDecode:
    """Runs decode-only steps of ``model`` (a :class:`worker.llama.LlamaModel` on CPU) over ``cache``
    with the fused operators ``ops`` (:func:`worker.step.fused.load`'s module); it serves steps with
    prompt chunks too (:meth:`forward_mixed`), whose rows are any count."""

    serves_prefill = True

    def __init__(self, model, cache, ops):
        self.model, self.cache, self.ops = model, cache, ops
        self.block_size = cache.block_size
        self.picks = [
            tuple(_native(f, model.dtype) for f in (layer.qkv, layer.o, layer.gate_up, layer.down))
            for layer in model.layers
        ]
        self._layers: dict[int, list[tuple]] = {}

    def layers(self, rows: int) -> list[tuple]:
        """Per layer, what a step of ``rows`` rows runs: (attention norm, q/k/v's input dtype and fn,
        its bias, o's, o's bias, MLP norm, gate/up's, down's, the KV cache, and the next layer's
        (attention norm, q/k/v's input dtype) or None for the last), resolved once per size."""
        got = self._layers.get(rows)
        if got is None:
            got = []
            for layer, picks, kv in zip(self.model.layers, self.picks, self.cache.layers, strict=True):
                (qa, qf), (oa, of), (ga, gf), (da, df) = (p(rows) for p in picks)
                if layer.qkv_bias is not None:  # the bias is added in the compute dtype, as eagerly
                    qa, qf = self.model.dtype, layer.qkv
                got.append((layer.attn_norm, qa, qf, layer.qkv_bias, oa, of, layer.o_bias, layer.mlp_norm))
                got[-1] += (ga, gf, da, df, kv)
            # each layer also carries the next one's attention norm and its output dtype (None for
            # the last): its residual add and that norm are one call
            got = [(*g, (n[0], n[1])) for g, n in itertools.pairwise(got)] + [(*got[-1], None)]
            self._layers[rows] = got
        return got

    @torch.inference_mode()
    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        tables: torch.Tensor,
        lens: torch.Tensor,
        seq: torch.Tensor | None = None,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One step. ``ids``, ``positions``, ``slots`` [T] (long): each row's token, its position and
        the cache slot its key and value go to; ``tables`` [N, W] block ids, ``lens`` [T] how many
        keys each row attends to (position + 1); ``seq`` [T] the table each row reads (None: row b
        reads table b, a decode step); ``keep`` the rows whose logits are wanted (None: all). Every
        row's key and value are written before any row attends, so the rows of one prompt chunk
        read each other's as the eager pass does. Returns float32 logits [len(keep) or T, V]."""
        m, ops = self.model, self.ops
        H, KVH, eps, dt, bs, scale = m.heads, m.kv_heads, m.eps, m.dtype, self.block_size, m.scale
        rope, attend, silu_mul, add_norm = ops.rope_cache, ops.paged_attention, ops.silu_mul, ops.add_rms_norm
        cos, sin = m.cos, m.sin_signed
        own = ids.new_empty(0) if seq is None else seq  # paged attention's seq: empty, row b reads table b
        x = m.embed(ids)  # [B, hidden] float32, a fresh tensor: the residual adds go in place
        layers = self.layers(ids.shape[0])
        h = ops.rms_norm(x, layers[0][0], eps, layers[0][1])
        for _, _, qkv, qkv_bias, oa, o, o_bias, n2, ga, gate_up, da, down, kv, after in layers:
            t = qkv(h)
            if qkv_bias is not None:
                t = t + qkv_bias
            q = rope(t, cos, sin, positions, kv, slots, H, KVH, dt)
            a = o(attend(q, kv, tables, own, lens, bs, scale, oa))
            if o_bias is not None:  # the bias added after o's output, as eagerly: two sums
                x.add_(a)
                a = o_bias.expand_as(x)
            h = add_norm(x, a, n2, eps, ga)
            d = down(silu_mul(gate_up(h), dt, da))
            if after is None:  # the last layer: the head normalises x itself
                x.add_(d)
            else:  # the next layer's attention norm, with this layer's residual add
                h = add_norm(x, d, after[0], eps, after[1])
        return m.head(x if keep is None else x.index_select(0, keep))

    def forward_rows(self, rows: list[tuple[list[int], int, int]]) -> torch.Tensor:
        """:meth:`forward` of decode rows ``(block_table, position, token)``."""
        return self.forward(*step_inputs(rows, self.block_size))

    def forward_mixed(self, rows: list[tuple[list[int], int, int]], chunks: list[tuple]) -> torch.Tensor:
        """:meth:`forward` of decode rows ``(block_table, position, token)`` and prompt chunks
        ``(block_table, start, end, tokens, last)`` (positions ``[start, end)``, their ``tokens``;
        ``last``: the chunk ends its prompt). Logits [R, V]: the decode rows', then each last chunk's
        final row's, in order (the eager pass's ``logit_rows``)."""
        return self.forward(*mixed_inputs(rows, chunks, self.block_size))


def step_inputs(decode: list[tuple[list[int], int, int]], block_size: int) -> list[torch.Tensor]:
    """The inputs of :meth:`FusedDecode.forward` for decode rows ``(block_table, position, token)``:
    ids, positions, slots, tables, lens (one tensor built from one list, then cut into views)."""
    tables = step_plan.padded_tables([t for t, _, _ in decode], [p + 1 for _, p, _ in decode], block_size)
    flat = [tok for _, _, tok in decode]
    flat += [p for _, p, _ in decode]
    flat += [step_plan.slot_of(t, p, block_size) for t, p, _ in decode]
    flat += [p + 1 for _, p, _ in decode]
    for row in tables:
        flat += row
    b = len(decode)
    t = torch.tensor(flat, dtype=torch.long)
    return [t[:b], t[b : 2 * b], t[2 * b : 3 * b], t[4 * b :].view(b, -1), t[3 * b : 4 * b]]


def mixed_inputs(decode: list[tuple[list[int], int, int]], chunks: list[tuple], block_size: int) -> list[torch.Tensor]:
    """The inputs of :meth:`FusedDecode.forward` for decode rows and prompt chunks
    (:meth:`FusedDecode.forward_mixed`): rows numbered decode rows first, then each chunk's tokens,
    as :func:`worker.attention.build_batch` numbers them; one table per decode row and per chunk
    (:func:`worker.attention.paged_rows`), ``seq`` mapping rows to them, ``keep`` the logit rows."""
    from worker.attention import paged_rows

    ids, positions = [tok for _, _, tok in decode], [p for _, p, _ in decode]
    keep = list(range(len(decode)))
    for _, start, end, tokens, last in chunks:
        ids += tokens
        positions += range(start, end)
        if last:
            keep.append(len(ids) - 1)
    cpu = torch.device("cpu")
    tables, seq, lens = paged_rows(block_size, cpu, [(t, p + 1) for t, p, _ in decode], [c[:3] for c in chunks])
    pos = torch.tensor(positions, dtype=torch.long)
    slots = tables[seq, pos // block_size] * block_size + pos % block_size
    return [torch.tensor(ids, dtype=torch.long), pos, slots, tables, lens, seq, torch.tensor(keep, dtype=torch.long)]
