"""Prompt logprobs: the log-probability the model gives each prompt token, computed during prefill.

A request whose ``SamplingParams.prompt_logprobs`` is set (``echo`` with ``logprobs`` on
``/v1/completions``) wants, for every prompt position ``p`` but the last, the logprob of token
``p + 1`` under the logits at row ``p``, and the ``k`` most likely tokens there. The forward pass
hands back those rows' final hidden states (:meth:`worker.llama.LlamaModel.forward`'s
``hidden_rows``), and :func:`score_rows` applies the LM head to them ``slice_rows`` rows at a time,
so a long chunk never holds ``[T, vocab]`` logits at once: each slice's logits become a
``log_softmax`` in float32, one gathered value and a top-k, and are dropped.

Values are raw (the model's own distribution at temperature 1, no penalties, bias or masks: what
vLLM returns as prompt logprobs), floored at ``LOGPROB_FLOOR`` like every logprob on the wire.

Which positions a chunk scores is :func:`positions`: a sequence's prompt logprobs are appended in
order, so a preempted sequence recomputing its prompt does not score a position twice.
"""

from __future__ import annotations

import torch

from worker.contract.protocol import LOGPROB_FLOOR, TokenLogprob

SLICE_BYTES = 64 * 2**20  # float32 logits of one slice of rows: bounds the extra memory of scoring


def slice_rows(vocab_size: int) -> int:
    """Rows of logits one slice holds (at least 1), ``SLICE_BYTES`` of float32 at most."""
    return max(1, SLICE_BYTES // (4 * vocab_size))


def positions(done: int, prompt_len: int, start: int, end: int) -> range:
    """The prompt positions whose next-token logprob a chunk ``[start, end)`` adds, given ``done``
    already scored (positions ``0 .. done-1``): ``[max(start, done), min(end, prompt_len - 1))``.
    Empty when the chunk starts past ``done`` (a position would be skipped: never scored out of order)."""
    if start > done:
        return range(0)
    return range(max(start, done), min(end, prompt_len - 1))


@torch.inference_mode()
def score_rows(head, hidden: torch.Tensor, targets: list[int], top: int, rows_per_slice: int) -> list[TokenLogprob]:
    """Logprob of ``targets[i]`` under ``head(hidden[i])`` and the ``top`` best tokens of that row.

    ``head``: hidden rows [S, H] -> float32 logits [S, V]; ``hidden``: [M, H], one row per target;
    computed ``rows_per_slice`` rows at a time. Returns M :class:`TokenLogprob` in order."""
    out: list[TokenLogprob] = []
    target = torch.tensor(targets, dtype=torch.long, device=hidden.device)
    for a in range(0, len(targets), rows_per_slice):
        b = min(a + rows_per_slice, len(targets))
        lp = torch.log_softmax(head(hidden[a:b]).float(), dim=-1)  # [S, V]
        chosen = lp.gather(1, target[a:b].unsqueeze(-1)).squeeze(-1).tolist()
        if top:
            vals, ids = torch.topk(lp, min(top, lp.shape[-1]), dim=-1)
            pairs = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), vals.tolist(), strict=True)]
        else:
            pairs = [[] for _ in range(b - a)]
        for t, v, alts in zip(targets[a:b], chosen, pairs, strict=True):
            out.append(TokenLogprob(token_id=t, logprob=_floor(v), top=[(i, _floor(x)) for i, x in alts]))
    return out


def _floor(v: float) -> float:
    return v if v > LOGPROB_FLOOR else LOGPROB_FLOOR
