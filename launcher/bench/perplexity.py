"""Perplexity arithmetic, llama.cpp's ``llama-perplexity`` method (tools/perplexity/perplexity.cpp,
its default mode), so our figure and its are comparable on the same model file and text. Pure.

* The text is tokenized once, with the tokenizer's own BOS when it adds one, and cut into
  ``len(tokens) // ctx`` non-overlapping windows of ``ctx`` tokens (the rest is dropped); at least
  two windows are needed. A window's first token is replaced by BOS when the tokenizer adds one.
* Each window is evaluated alone from an empty cache, and only its second half is scored: the
  logits at positions ``first = ctx // 2`` .. ``ctx - 2`` predict tokens ``first + 1`` .. ``ctx - 1``,
  ``ctx - first - 1`` tokens per window, so every scored token has at least ``ctx / 2`` of context.
* ``PPL = exp(mean nll)`` over all scored tokens, and its ± is llama.cpp's:
  ``sqrt((mean(nll²) − mean(nll)²) / (count − 1)) × PPL``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


class TooShort(ValueError):
    """The text gives fewer than two windows of ``ctx`` tokens (llama-perplexity refuses it too)."""


def windows(tokens: Sequence[int], ctx: int, bos: int | None, limit: int | None = None) -> list[list[int]]:
    """The token windows to evaluate: ``len(tokens) // ctx`` of ``ctx`` tokens (at most ``limit``,
    llama-perplexity's ``--chunks``), each starting with ``bos`` when it is not None. Raises
    :class:`TooShort` below two windows."""
    if ctx < 4:
        raise ValueError(f"a window of {ctx} tokens is too small to score")
    if len(tokens) < 2 * ctx:
        raise TooShort(f"the text tokenizes to {len(tokens)} tokens; a context of {ctx} needs at least {2 * ctx}")
    count = len(tokens) // ctx if limit is None else min(limit, len(tokens) // ctx)
    out = []
    for i in range(count):
        w = list(tokens[i * ctx : (i + 1) * ctx])
        if bos is not None:
            w[0] = bos
        out.append(w)
    return out


def scored(token_logprobs: Sequence[float | None], ctx: int) -> list[float]:
    """The negative log-likelihoods a window contributes: ``token_logprobs`` is the window's echo
    (one per token, the first null), and its entries ``ctx // 2 + 1`` .. ``ctx - 1`` are scored."""
    if len(token_logprobs) != ctx:
        raise ValueError(f"{len(token_logprobs)} logprobs for a window of {ctx} tokens")
    first = ctx // 2
    return [-float(v) for v in token_logprobs[first + 1 : ctx]]


@dataclass
class Estimate:
    """A perplexity and its uncertainty over ``count`` scored tokens."""

    ppl: float
    error: float  # llama.cpp's "+/-"
    count: int
    mean_nll: float


def estimate(nlls: Iterable[float]) -> Estimate:
    """llama-perplexity's final estimate from every scored token's negative log-likelihood."""
    total = total2 = 0.0
    count = 0
    for v in nlls:
        total += v
        total2 += v * v
        count += 1
    if count < 2:
        raise ValueError("need at least two scored tokens")
    mean = total / count
    var = total2 / count - mean * mean
    ppl = math.exp(mean)
    error = math.sqrt(var / (count - 1)) * ppl if var > 0 else 0.0
    return Estimate(ppl=ppl, error=error, count=count, mean_nll=mean)
