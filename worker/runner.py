"""Turning one scheduled step into one forward pass: flattened token ids, positions, attention
metadata and which rows' logits are wanted.

Rows are laid out decode sequences first (one token each), then each prefill chunk's tokens. The
logits come back in the order :meth:`worker.scheduler.Scheduler.finish_step` returns the sequences
to sample: the decode rows, then the last row of every chunk that completes its sequence's tokens.
"""

from __future__ import annotations

import torch

from worker.attention import KVCache, build_batch
from worker.scheduler import Plan


class ModelRunner:
    """Runs :class:`~worker.llama.LlamaModel` (or anything with its ``forward`` signature) over the
    block cache ``cache``."""

    def __init__(self, model, cache: KVCache, device: torch.device):
        self.model = model
        self.cache = cache
        self.device = device

    def run(self, plan: Plan) -> torch.Tensor:
        """One forward pass for ``plan``. Returns float32 logits [N, V] for the sequences to sample."""
        ids: list[int] = []
        positions: list[int] = []
        decode = []
        for seq in plan.decode:
            ids += seq.tokens(seq.computed, seq.computed + 1)
            positions.append(seq.computed)
            decode.append((seq.table.blocks, seq.computed + 1))
        logit_rows = list(range(len(ids)))
        prefill = []
        for seq, start, end in plan.prefill:
            ids += seq.tokens(start, end)
            positions += range(start, end)
            prefill.append((seq.table.blocks, start, end))
            if end == seq.num_tokens:
                logit_rows.append(len(ids) - 1)
        batch = build_batch(self.cache.block_size, self.device, decode, prefill)
        as_long = {"dtype": torch.long, "device": self.device}
        return self.model.forward(
            torch.tensor(ids, **as_long),
            torch.tensor(positions, **as_long),
            batch,
            self.cache,
            torch.tensor(logit_rows, **as_long),
        )
