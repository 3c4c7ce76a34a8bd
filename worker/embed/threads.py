"""How many torch threads an embedding forward pass uses on CPU.

A one-sentence batch (tens of tokens) is a handful of small matrix products: splitting them over
cores costs more in OpenMP hand-offs than it saves, and on a box whose cores are busy elsewhere a
2-thread pass waits at every barrier for a descheduled thread (MiniLM-L6, 12 tokens, AMD EPYC at
load ~8: 51 ms with 1 thread, 790 ms with 2). So a batch under :data:`PARALLEL_TOKENS` padded tokens
runs on one thread and a larger one on all the worker's cores, where the work per barrier is large.
"""

from __future__ import annotations

import torch

PARALLEL_TOKENS = 512  # padded tokens (inputs x longest) from which a batch is worth several threads


class ThreadPlan:
    """Sets torch's intra-op threads per batch: 1 below :data:`PARALLEL_TOKENS`, else ``cores``
    (the thread count the worker was given: its pinned cores, or torch's default)."""

    def __init__(self, cores: int | None = None):
        self.cores = max(1, cores if cores is not None else torch.get_num_threads())

    def threads_for(self, padded_tokens: int) -> int:
        """The thread count for a batch of ``padded_tokens`` (inputs x longest input)."""
        return 1 if padded_tokens < PARALLEL_TOKENS else self.cores

    def apply(self, padded_tokens: int) -> None:
        """Set torch's thread count for this batch (only when it changes: the call is not free)."""
        want = self.threads_for(padded_tokens)
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)
