"""Turning one scheduled step into one forward pass: flattened token ids, positions, attention
metadata and which rows' logits are wanted.

Rows are laid out decode sequences first (one token each), then each prefill chunk's tokens. The
logits come back in the order :meth:`worker.scheduler.Scheduler.finish_step` returns the sequences
to sample: the decode rows, then the last row of every chunk that completes its sequence's tokens.
A sequence that asked for prompt logprobs also gets its chunk's prompt positions scored
(:mod:`worker.prompt_logprobs`) from those rows' hidden states, appended to ``seq.prompt_logprobs``.

In a tensor-parallel replica rank 0's runner has the ranks' ``group`` and announces every step
to the other ranks before running it (:mod:`worker.tp`); they run the same :meth:`forward`.
"""

from __future__ import annotations

import torch

from worker import prompt_logprobs
from worker.attention import KVCache, build_batch
from worker.scheduler import StepPlan


class ModelRunner:
    """Runs :class:`~worker.llama.LlamaModel` (or anything with its ``forward`` signature) over the
    block cache ``cache``; with ``group`` (a :class:`worker.tp.TPGroup`, rank 0) every step is
    broadcast to the other ranks first; ``capture`` (a :class:`worker.step.capture.StepCapture`, or
    None) serves the decode-only steps it covers."""

    def __init__(self, model, cache: KVCache, device: torch.device, group=None, capture=None):
        self.model = model
        self.cache = cache
        self.device = device
        self.group = group
        # An OOM in a tensor-parallel forward leaves the ranks at different collectives: not retried.
        self.oom_recoverable = group is None
        self.capture = capture  # a worker.step.capture.StepCapture: decode-only steps without Python per op

    def step_counts(self) -> dict[str, int]:
        """The captured and eager decode steps so far (:meth:`worker.step.capture.StepCapture.counts`)."""
        return self.capture.counts() if self.capture is not None else {}

    def run(self, plan: StepPlan) -> torch.Tensor:
        """One forward pass for ``plan``. Returns float32 logits [N, V] for the sequences to sample."""
        if self.capture is not None and (logits := self.capture.serve(plan)) is not None:
            return logits
        ids: list[int] = []
        positions: list[int] = []
        decode = []
        for seq in plan.decode:
            ids += seq.tokens(seq.computed, seq.computed + 1)
            positions.append(seq.computed)
            decode.append((seq.table.blocks, seq.computed + 1))
        logit_rows = list(range(len(ids)))
        prefill = []
        scored: list[tuple[object, range, int]] = []  # (sequence, prompt positions, first row) to score
        for seq, start, end in plan.prefill:
            if (span := _prompt_positions(seq, start, end)) is not None:
                scored.append((seq, span, len(ids) + span.start - start))
            ids += seq.tokens(start, end)
            positions += range(start, end)
            prefill.append((seq.table.blocks, start, end))
            if end == seq.num_tokens:
                logit_rows.append(len(ids) - 1)
        as_long = {"dtype": torch.long, "device": self.device}
        if self.group is not None:
            self.group.send_step(ids, positions, decode, prefill, self.cache.block_size)
        hidden_rows = [row + i for _, span, row in scored for i in range(len(span))]
        out = self.forward(
            torch.tensor(ids, **as_long),
            torch.tensor(positions, **as_long),
            decode,
            prefill,
            torch.tensor(logit_rows, **as_long),
            torch.tensor(hidden_rows, **as_long) if hidden_rows else None,
        )
        if not hidden_rows:
            return out
        logits, hidden = out
        self._score(scored, hidden)
        return logits

    def _score(self, scored: list, hidden: torch.Tensor) -> None:
        """Prompt logprobs of this step's scored positions (``hidden``: their rows, in ``scored``'s
        order), computed for every sequence before any is given its own: an out-of-memory error
        midway leaves every sequence as it was, and the step is retried whole."""
        rows = prompt_logprobs.slice_rows(self.model.config.vocab_size)
        results, at = [], 0
        for seq, span, _ in scored:
            targets = seq.prompt[span.start + 1 : span.stop + 1]
            k = seq.params.prompt_logprobs
            results.append(prompt_logprobs.score_rows(self.model.head, hidden[at : at + len(span)], targets, k, rows))
            at += len(span)
        for (seq, _, _), got in zip(scored, results, strict=True):
            seq.prompt_logprobs.extend(got)

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        decode: list[tuple[list[int], int]],
        prefill: list[tuple[list[int], int, int]],
        logit_rows: torch.Tensor | None,
        hidden_rows: torch.Tensor | None = None,
    ):
        """The forward pass of one step given its rows (``ids``, ``positions`` [T]) and
        :func:`~worker.attention.build_batch`'s ``decode``/``prefill``; ``logit_rows`` None (the
        other ranks of a tensor-parallel replica) computes no logits and returns None. With
        ``hidden_rows`` it returns ``(logits, hidden states of those rows)`` (prompt logprobs)."""
        batch = build_batch(self.cache.block_size, self.device, decode, prefill)
        if hidden_rows is None:
            return self.model.forward(ids, positions, batch, self.cache, logit_rows)
        return self.model.forward(ids, positions, batch, self.cache, logit_rows, hidden_rows)

    def idle(self) -> None:
        """Called by the serving loop on every turn: when no step went to the other ranks for a
        while, a keep-alive does (:meth:`worker.tp.TPGroup.send_idle`), so their wait for the next
        step does not time out while this rank has nothing to run."""
        if self.group is not None:
            self.group.send_idle()


def _prompt_positions(seq, start: int, end: int) -> range | None:
    """The prompt positions chunk ``[start, end)`` of ``seq`` scores; None when it asked for no
    prompt logprobs or has none left to score there."""
    params = getattr(seq, "params", None)  # warm-up and calibration passes run scratch sequences
    if params is None or params.prompt_logprobs is None:
        return None
    span = prompt_logprobs.positions(len(seq.prompt_logprobs), len(seq.prompt), start, end)
    return span if len(span) else None
