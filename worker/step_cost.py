"""How many prompt tokens a CPU step may prefill beside its decodes so that the step takes at most
``ratio`` times a decode-only step of the same rows, from costs measured at start
(:func:`worker.replica.calibrate_step_cost`). Pure arithmetic, no torch; the scheduler asks it.

A decode-only step of ``r`` rows takes ``decode_s + decode_row_s * r``. A prefill chunk of ``n``
prompt tokens at positions ``[s, s + n)`` adds

    chunk_s + token_s * n + key_s * keys(s, n),      keys(s, n) = n * s + n * (n + 1) / 2

seconds to it: a fixed part (a step with a chunk runs the eager forward pass, a decode-only step
the captured one), the tokens' matmuls (compute-bound on a CPU, so proportional to the tokens), and
their attention, each token over every key before it and itself (``keys``). The last grows with
the position, so a budget counted in tokens alone gives a document's last chunks steps much longer
than its first ones; counted in these costs every chunk step stays within the same bound.

The scheduler counts a step's budget in *token equivalents*, a prompt token's matmul cost
(``token_s``): :meth:`StepCost.budget` is what a step of ``r`` decode rows may spend,
:meth:`StepCost.weight` what a chunk spends of it (its tokens plus its attention), and
:meth:`StepCost.tokens_within` the longest chunk a budget pays for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def keys(start: int, tokens: int) -> int:
    """Keys attended by a chunk of ``tokens`` prompt tokens at positions ``[start, start + tokens)``:
    position ``p`` attends to ``p + 1`` keys (its own included)."""
    return tokens * start + tokens * (tokens + 1) // 2


@dataclass(frozen=True)
class StepCost:
    """Measured step costs on this machine, seconds (module docstring); ``ratio``: the bound on a
    step with a chunk, in decode-only steps of the same rows."""

    decode_s: float
    decode_row_s: float
    chunk_s: float
    token_s: float
    key_s: float
    ratio: float

    def decode_step_s(self, rows: int) -> float:
        """A decode-only step of ``rows`` rows, seconds."""
        return self.decode_s + self.decode_row_s * rows

    def budget(self, rows: int) -> float:
        """Token equivalents a step of ``rows`` decode rows may prefill: what ``ratio`` leaves over
        the decode step and the chunk's fixed part, in prompt tokens' matmul time (0 when nothing is
        left; the scheduler still gives a long prompt its one token a step)."""
        spare = (self.ratio - 1.0) * self.decode_step_s(rows) - self.chunk_s
        return max(0.0, spare / self.token_s)

    @property
    def key_weight(self) -> float:
        """One attended key in token equivalents."""
        return self.key_s / self.token_s

    def weight(self, start: int, tokens: int) -> float:
        """What a chunk of ``tokens`` at positions ``[start, start + tokens)`` spends of a budget."""
        return tokens + self.key_weight * keys(start, tokens)

    def tokens_within(self, start: int, budget: float) -> int:
        """The most tokens a chunk starting at position ``start`` may take within ``budget`` token
        equivalents (0 when not one fits): the root of ``weight(start, n) = budget``, a quadratic."""
        if budget <= 0:
            return 0
        kw = self.key_weight
        if kw <= 0:
            return int(budget)
        b = 1.0 + kw * (start + 0.5)  # weight(s, n) = kw/2 n^2 + b n
        n = int((-b + math.sqrt(b * b + 2.0 * kw * budget)) / kw)
        while n > 0 and self.weight(start, n) > budget:  # float rounding at the root
            n -= 1
        while self.weight(start, n + 1) <= budget:
            n += 1
        return n

    @classmethod
    def fit(cls, decode: dict[int, float], beside: int, chunks: dict[tuple[int, int], float], ratio: float) -> StepCost:
        """The costs from timed steps: ``decode`` maps two row counts to a decode-only step's
        seconds (one: a step's rows then cost nothing apart); ``chunks`` maps ``(tokens, start)`` to the seconds of a step of ``beside`` decode
        rows plus one such chunk, for two token counts at each of two starts (a 2 × 2 design: the
        attention's cost from the starts' difference, the tokens' from the counts'). Negative
        estimates (timing noise) are taken as zero; ``token_s`` is kept positive.
        Raises ValueError for another design."""
        rows = sorted(decode)
        counts = sorted({n for n, _ in chunks})
        starts = sorted({s for _, s in chunks})
        if len(rows) not in (1, 2) or len(counts) != 2 or len(starts) != 2 or len(chunks) != 4:
            raise ValueError("fit needs decode steps at one or two row counts and chunks of two sizes at two starts")
        decode_row_s = max(0.0, (decode[rows[-1]] - decode[rows[0]]) / (rows[-1] - rows[0])) if rows[1:] else 0.0
        decode_s = max(0.0, decode[rows[0]] - decode_row_s * rows[0])
        base = decode_s + decode_row_s * beside
        extra = {k: t - base for k, t in chunks.items()}
        (n0, n1), (s0, s1) = counts, starts
        # keys(s1, n) - keys(s0, n) = n * (s1 - s0): the attention's part of the starts' difference
        rise = sum(extra[(n, s1)] - extra[(n, s0)] for n in counts)
        key_s = max(0.0, rise / ((n0 + n1) * (s1 - s0)))
        per = {n: sum(extra[(n, s)] - key_s * keys(s, n) for s in starts) / 2 for n in counts}
        token_s = max(1e-9, (per[n1] - per[n0]) / (n1 - n0))
        chunk_s = max(0.0, per[n0] - token_s * n0)
        return cls(decode_s, decode_row_s, chunk_s, token_s, key_s, ratio)

    def describe(self, rows: int) -> str:
        """One log line's worth: the measured costs and the chunks they allow beside ``rows`` decodes."""
        b = self.budget(rows)
        return (
            f"decode step {1e3 * self.decode_s:.1f} ms + {1e3 * self.decode_row_s:.2f} ms/row; a chunk adds "
            f"{1e3 * self.chunk_s:.1f} ms + {1e3 * self.token_s:.2f} ms/token + {1e6 * self.key_s:.2f} ms per 1k keys; "
            f"beside {rows} decodes a step within {self.ratio:g}x takes {self.tokens_within(0, b)} tokens at the "
            f"prompt's start, {self.tokens_within(1024, b)} at position 1024"
        )
