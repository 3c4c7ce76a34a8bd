"""Which engine steps the captured decode step serves, and in which batch-size bucket: pure logic,
shared by the CPU's fused step (:mod:`worker.step.decode`) and CUDA graphs (:mod:`worker.step.graphs`).

A captured step is a decode-only step (every row one token of a running sequence) of at most the
largest bucket's rows, as vLLM and gpt-fast capture theirs. The buckets are vLLM's capture sizes:
1, 2, 4, then every multiple of 8 up to ``max_num_seqs`` (which is always one). Anything else runs
the eager forward pass and is counted: a step with a prefill chunk (on CPU the fused step serves
those too: :meth:`worker.step.capture.StepCapture.serve`; prompt logprobs are computed only
eagerly), more decode rows than the largest bucket, a tensor-parallel or layer-split replica
(whose forward sums over ranks / moves between devices), or capture turned off
(``workers.enforce_eager``).
"""

from __future__ import annotations

PREFILL = "prefill"  # the step computes prompt tokens: not a bucket's step, not counted as a miss
OVER_BUCKETS = "over_buckets"


def buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes captured for ``max_num_seqs`` sequences: 1, 2, 4, 8, 16, 24, … ``max_num_seqs``
    (vLLM's ``cudagraph_capture_sizes``), ascending, the last always ``max_num_seqs``."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return [*sizes, max_num_seqs]


def bucket_for(rows: int, sizes: list[int]) -> int | None:
    """The smallest bucket of ``sizes`` holding ``rows`` rows; None when none does."""
    for size in sizes:
        if size >= rows:
            return size
    return None


def route(decode_rows: int, prefill_chunks: int, sizes: list[int]) -> tuple[int | None, str | None]:
    """``(bucket, None)`` when the captured step serves a step of ``decode_rows`` decode rows and
    ``prefill_chunks`` prompt chunks, else ``(None, reason)``: :data:`PREFILL` or :data:`OVER_BUCKETS`."""
    if prefill_chunks or not decode_rows:
        return None, PREFILL
    size = bucket_for(decode_rows, sizes)
    return (size, None) if size is not None else (None, OVER_BUCKETS)


def slot_of(table: list[int], position: int, block_size: int) -> int:
    """The cache slot of token ``position`` of a sequence whose block table is ``table``."""
    return table[position // block_size] * block_size + position % block_size


def padded_tables(tables: list[list[int]], lengths: list[int], block_size: int) -> list[list[int]]:
    """Each row's blocks holding its first ``lengths[i]`` tokens, padded with block 0 to the widest:
    one rectangular table (the padding is never read: a row reads only its own length)."""
    used = [table[: -(-n // block_size)] for table, n in zip(tables, lengths, strict=True)]
    width = max(len(t) for t in used)
    return [t + [0] * (width - len(t)) for t in used]
