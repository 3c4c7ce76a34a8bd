"""The runner's switch between the captured decode step and the eager forward pass, and its counts.

:func:`build` sets it up for a replica: the fused CPU step (:mod:`worker.step.decode`) or CUDA
graphs (:mod:`worker.step.graphs`) where the model supports it and ``workers.enforce_eager`` is off,
resolving (CPU) or capturing (CUDA) each batch-size bucket once and logging what it built (or
compiled) and how long it took. :meth:`StepCapture.serve` runs a step
through it when :func:`worker.step.plan.route` says it can and returns None otherwise, counting the
decode-only steps it could not serve (``eager_decode_steps``: capture off or unavailable, more rows
than the largest bucket) beside those it served (``captured_steps``), which the heartbeat reports.
On CPU the fused step also serves steps with prompt chunks (a chunk's tokens are rows of any
count), except those scoring prompt logprobs; CUDA graphs have fixed shapes and leave them eager.
"""

from __future__ import annotations

import logging
import time

import torch

from worker.step import plan as step_plan

log = logging.getLogger(__name__)


class StepCapture:
    """Serves decode-only steps through ``fused`` (a :class:`worker.step.decode.FusedDecode` on CPU,
    a :class:`worker.step.graphs.GraphDecode` on CUDA; None: every step eager) for batch sizes up to
    the last of ``sizes``."""

    def __init__(self, fused, sizes: list[int], block_size: int):
        self.fused, self.sizes, self.block_size = fused, sizes, block_size
        self.captured_steps = 0  # decode-only steps and steps with prompt chunks it served
        self.prefill_steps = 0  # of those, the steps with prompt chunks
        self.eager_decode_steps = 0

    def serve(self, plan) -> torch.Tensor | None:
        """Float32 logits [B, V] of ``plan``'s decode rows by the captured step, or None: the caller
        runs the step eagerly (a prefill chunk in it, too many rows, capture off)."""
        bucket, why = step_plan.route(len(plan.decode), len(plan.prefill), self.sizes)
        if why == step_plan.PREFILL:
            return self._mixed(plan)
        if bucket is None or self.fused is None:
            self.eager_decode_steps += 1
            return None
        rows = _decode_rows(plan)
        logits = self.fused.forward_rows(rows)
        self.captured_steps += 1
        return logits

    def _mixed(self, plan) -> torch.Tensor | None:
        """Logits of a step with prompt chunks by the fused CPU step (rows of any count: a chunk's
        tokens are rows reading their own prompt's keys), or None where it cannot serve it: no fused
        step, CUDA graphs (fixed shapes), or a chunk whose prompt logprobs are wanted (the eager pass
        returns the hidden rows they are scored from)."""
        if not getattr(self.fused, "serves_prefill", False) or any(_scored(seq) for seq, _, _ in plan.prefill):
            return None
        rows = _decode_rows(plan)
        chunks = [(s.table.blocks, a, b, s.tokens(a, b), b == s.num_tokens) for s, a, b in plan.prefill]
        logits = self.fused.forward_mixed(rows, chunks)
        self.captured_steps += 1
        self.prefill_steps += 1
        return logits

    def counts(self) -> dict[str, int]:
        """The heartbeat's figures (:class:`worker.contract.protocol.EngineLoad` fields)."""
        return {"captured_steps": self.captured_steps, "eager_decode_steps": self.eager_decode_steps}


def _decode_rows(plan) -> list[tuple[list[int], int, int]]:
    """``plan``'s decode rows as the fused step takes them: (block table, position, token)."""
    return [(s.table.blocks, s.computed, s.tokens(s.computed, s.computed + 1)[0]) for s in plan.decode]


def _scored(seq) -> bool:
    """``seq`` asked for prompt logprobs (warm-up and calibration passes run scratch sequences
    without parameters)."""
    params = getattr(seq, "params", None)
    return params is not None and params.prompt_logprobs is not None


def build(model, cache, max_num_seqs: int, enforce_eager: bool, group=None, max_model_len: int = 0) -> StepCapture:
    """The replica's :class:`StepCapture`: the fused CPU step, or CUDA graphs of ``max_model_len``
    tokens' tables, for ``model`` over ``cache`` unless ``enforce_eager``, the model cannot use it,
    or it cannot be built (each said in one log line), with every bucket of
    :func:`worker.step.plan.buckets` resolved (CPU) or captured (CUDA) now."""
    sizes = step_plan.buckets(max_num_seqs)
    off = _why_eager(model, cache, enforce_eager, group)
    step = None
    if off is None and cache.layers[0].device.type == "cuda":
        step, off = _graphs(model, cache, sizes, max_model_len)
    elif off is None:
        step, off = _fused(model, cache, sizes)
    if off is not None:
        log.info("decode steps run eagerly: %s", off)
    return StepCapture(step, sizes, cache.block_size)


def graph_pool_bytes(model, scratch, max_num_seqs: int, enforce_eager: bool, group=None, max_model_len: int = 0) -> int:
    """Bytes :func:`build` will need on the GPU for CUDA graphs beyond the KV cache
    (:func:`worker.step.graphs.pool_bytes`), measured over ``scratch`` (a one-block cache on the
    model's devices) before the cache is sized; 0 where :func:`build` will capture none (CPU,
    ``enforce_eager``, a model the step cannot serve)."""
    if max_model_len < 1 or scratch.layers[0].device.type != "cuda":
        return 0
    if _why_eager(model, scratch, enforce_eager, group) is not None:
        return 0
    from worker.step.graphs import pool_bytes

    return pool_bytes(model, scratch, step_plan.buckets(max_num_seqs), -(-max_model_len // scratch.block_size))


def _why_eager(model, cache, enforce_eager: bool, group=None) -> str | None:
    """Why no step is captured for ``model`` over ``cache`` whatever the device (None: one can be)."""
    from worker.step.decode import unsupported

    return "workers.enforce_eager is set" if enforce_eager else unsupported(model, cache, group)


def _fused(model, cache, sizes: list[int]):
    """``(FusedDecode, None)``, or ``(None, why not)``."""
    from worker.step import fused as fused_ops
    from worker.step.decode import FusedDecode

    start = time.monotonic()
    ops = fused_ops.load()
    if ops is None:
        return None, "the fused operators could not be built"
    step = FusedDecode(model, cache, ops)
    for size in sizes:
        step.layers(size)
    log.info(
        "decode step captured for batch sizes %s (fused CPU operators, ready in %.1fs)", sizes, time.monotonic() - start
    )
    return step, None


def _graphs(model, cache, sizes: list[int], max_model_len: int):
    """``(GraphDecode, None)`` with every bucket captured, or ``(None, why not)``."""
    from worker.step.graphs import GraphDecode

    if max_model_len < 1:
        return None, "no max_model_len for the graphs' block tables"
    step = GraphDecode(model, cache, sizes, -(-max_model_len // cache.block_size))
    try:
        step.capture()
    except Exception as exc:  # any failure to capture leaves the worker serving eagerly
        log.exception("capturing CUDA graphs failed")
        return None, f"capturing CUDA graphs failed ({type(exc).__name__}: {exc})"
    return step, None
