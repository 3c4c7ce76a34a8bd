"""Figures from request timelines: pure functions over :class:`Sample` lists, no I/O.

Times are ``time.perf_counter()`` seconds. A *chunk* is one streamed SSE event that carried
content (a role-only or empty first event is not a chunk), so TTFT is the time to the first
content and an inter-token gap (ITL) is the gap between two content chunks.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from itertools import pairwise


@dataclass
class Sample:
    """One request's timeline.

    ``kind``: warmup | measured | filler (closed loop) or the scenario's own name. ``chunks``: the
    arrival time of each content chunk. ``completion_tokens``/``prompt_tokens``: the server's
    ``usage`` (None when it sent none). ``cut``: cancelled by the bench while still streaming.
    """

    kind: str
    start: float
    chunks: list[float] = field(default_factory=list)
    end: float | None = None
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    error: str | None = None
    cut: bool = False

    @property
    def ok(self) -> bool:
        """Answered without error: streamed content, or at least counted output tokens (a
        constrained answer may be all whitespace, which a server need not stream)."""
        return self.error is None and (bool(self.chunks) or bool(self.completion_tokens))

    @property
    def ttft(self) -> float | None:
        return self.chunks[0] - self.start if self.chunks else None

    @property
    def gaps(self) -> list[float]:
        """Gaps between consecutive content chunks, seconds."""
        return [b - a for a, b in pairwise(self.chunks)]

    @property
    def tokens(self) -> int:
        """Output tokens: the server's count, else one per chunk."""
        return self.completion_tokens if self.completion_tokens is not None else len(self.chunks)


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) by nearest rank on the sorted values; None when empty."""
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None when either is missing or ``b`` is zero."""
    return a / b if a is not None and b else None


def summarize(samples: list[Sample], start: float, end: float, output_tokens: int) -> dict:
    """A closed loop's window throughput and its measured requests' latencies.

    Every chunk streamed inside [start, end] counts, whichever request carried it (a chunk counts
    as ``completion_tokens / chunks`` tokens); requests/s counts request-equivalents served in the
    window (each request contributes the share of its tokens that fell inside it; a filler cut off
    at the end, whose total is unknown, counts against ``output_tokens``).
    """
    span = end - start
    tokens = served = 0.0
    for s in samples:
        if not s.ok or not s.chunks:  # a window counts streamed chunks only
            continue
        per_chunk = s.tokens / len(s.chunks)
        inside = per_chunk * sum(start <= t <= end for t in s.chunks)
        tokens += inside
        served += inside / (s.completion_tokens or max(output_tokens, len(s.chunks)))
    measured = [s for s in samples if s.kind == "measured"]
    ok = [s for s in measured if s.ok]
    return {
        "requests": len(measured),
        "failures": len(measured) - len(ok),
        "window_s": round(span, 2),
        "requests_per_s": served / span if span > 0 else None,
        "output_tokens_per_s": tokens / span if span > 0 else None,
        **latencies(ok),
        "errors": sorted({s.error for s in measured if s.error})[:3],
    }


def latencies(ok: list[Sample]) -> dict:
    """TTFT p50/p95, ITL p50 (over all gaps of all samples), end-to-end p50/p95, mean lengths."""
    ttft = [s.ttft for s in ok if s.chunks]
    gaps = [g for s in ok for g in s.gaps]
    out_tokens = [s.completion_tokens for s in ok if s.completion_tokens is not None]
    in_tokens = [s.prompt_tokens for s in ok if s.prompt_tokens is not None]
    e2e = [s.end - s.start for s in ok if s.end is not None]
    return {
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p95_s": percentile(ttft, 95),
        "itl_p50_s": percentile(gaps, 50),
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p95_s": percentile(e2e, 95),
        "mean_output_tokens": statistics.mean(out_tokens) if out_tokens else None,
        "mean_prompt_tokens": statistics.mean(in_tokens) if in_tokens else None,
    }


def batch_summary(samples: list[Sample]) -> dict:
    """Requests sent one after another or all at once: output tok/s over the whole span.

    The span runs from the first request's start to the last one's end, so it includes every
    TTFT; tokens are the sum over successful requests.
    """
    ok = [s for s in samples if s.ok]
    span = (max(s.end for s in ok) - min(s.start for s in ok)) if ok else 0.0
    tokens = sum(s.tokens for s in ok)
    return {
        "requests": len(samples),
        "failures": len(samples) - len(ok),
        "window_s": round(span, 3),
        "output_tokens_per_s": tokens / span if span > 0 else None,
        **latencies(ok),
        "errors": sorted({s.error for s in samples if s.error})[:3],
    }


def stall_summary(streams: list[Sample], doc: Sample) -> dict:
    """How long running streams stall while ``doc`` prefills.

    The prefill window runs from ``doc``'s start to its first content chunk. ``max_gap_s`` is the
    longest gap between two consecutive chunks of any stream that overlaps that window;
    ``median_gap_s`` is the median of the streams' other gaps (their pace without the document);
    ``gap_ratio`` is their quotient (the engine's target: at most 3). ``spanning`` counts the
    streams with a chunk before the window and one after it (a stream without both did not run
    through the prefill, and its stall is not observed).
    """
    if not doc.ok or not doc.chunks:
        return {
            "prefill_s": None,
            "max_gap_s": None,
            "median_gap_s": None,
            "gap_ratio": None,
            "spanning": 0,
            "streams": len(streams),
            "error": doc.error or "the document streamed no content",
        }
    w0, w1 = doc.start, doc.chunks[0]
    inside: list[float] = []
    outside: list[float] = []
    spanning = 0
    for s in streams:
        spanning += any(t < w0 for t in s.chunks) and any(t > w1 for t in s.chunks)
        for a, b in pairwise(s.chunks):
            (inside if b > w0 and a < w1 else outside).append(b - a)
    longest = max(inside, default=None)
    median = statistics.median(outside) if outside else None
    return {
        "prefill_s": w1 - w0,
        "max_gap_s": longest,
        "median_gap_s": median,
        "gap_ratio": ratio(longest, median),
        "spanning": spanning,
        "streams": len(streams),
        "error": None,
    }
