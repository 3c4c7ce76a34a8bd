"""Recent throughput and TTFT of one router, for the status page's charts: a ring of time buckets.

The router's own numbers, counted as token events arrive (:class:`router.metrics.RequestTimer`
feeds it beside the Prometheus histograms), so the page needs no Prometheus. Each bucket covers
``bucket_s`` seconds of wall time; the last ``span_s`` seconds are kept, in memory only.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass

BUCKET_S = 2.0
SPAN_S = 300.0


@dataclass
class _Bucket:
    index: int  # int(start time / bucket_s)
    tokens: int = 0  # generated tokens received from workers
    finished: int = 0  # requests that got their finish_reason
    first_tokens: int = 0  # requests whose first token arrived
    ttft_sum_s: float = 0.0
    ttft_max_s: float = 0.0


class Activity:
    """Counts of the last ``span_s`` seconds in ``bucket_s`` buckets. ``clock``: Unix seconds."""

    def __init__(self, bucket_s: float = BUCKET_S, span_s: float = SPAN_S, clock: Callable[[], float] = time.time):
        self.bucket_s = bucket_s
        self.size = max(1, round(span_s / bucket_s))
        self.clock = clock
        self._buckets: collections.deque[_Bucket] = collections.deque(maxlen=self.size)

    def _now(self) -> _Bucket:
        index = int(self.clock() // self.bucket_s)
        if not self._buckets or self._buckets[-1].index != index:
            self._buckets.append(_Bucket(index))
        return self._buckets[-1]

    def first_token(self, ttft_s: float) -> None:
        """A request got its first token ``ttft_s`` seconds after it arrived."""
        b = self._now()
        b.first_tokens += 1
        b.ttft_sum_s += ttft_s
        b.ttft_max_s = max(b.ttft_max_s, ttft_s)

    def tokens(self, count: int) -> None:
        """``count`` generated tokens arrived from a worker."""
        self._now().tokens += count

    def finished(self) -> None:
        """A request ended with a finish_reason."""
        self._now().finished += 1

    def history(self) -> dict:
        """``{"bucket_s", "now", "buckets": [...]}``, every bucket of the span oldest first, empty
        ones included: ``t`` (start, Unix s), ``tokens_per_s``, ``requests_per_s`` (finished),
        ``first_tokens`` (requests whose first token came in it), ``ttft_mean_s`` and ``ttft_max_s`` (None without a first token in it). The current bucket's
        rates are over its elapsed part, so the newest point does not dip."""
        now = self.clock()
        last = int(now // self.bucket_s)
        by_index = {b.index: b for b in self._buckets}
        out = []
        for index in range(last - self.size + 1, last + 1):
            b = by_index.get(index) or _Bucket(index)
            span = min(self.bucket_s, max(now - index * self.bucket_s, 1e-3)) if index == last else self.bucket_s
            out.append(
                {
                    "t": round(index * self.bucket_s, 3),
                    "tokens_per_s": round(b.tokens / span, 2),
                    "requests_per_s": round(b.finished / span, 3),
                    "first_tokens": b.first_tokens,
                    "ttft_mean_s": round(b.ttft_sum_s / b.first_tokens, 4) if b.first_tokens else None,
                    "ttft_max_s": round(b.ttft_max_s, 4) if b.first_tokens else None,
                }
            )
        return {"bucket_s": self.bucket_s, "now": round(now, 3), "buckets": out}
