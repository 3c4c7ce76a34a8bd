"""The mixed suite's figures, from its timelines: pure functions, no I/O (:mod:`launcher.bench.mixed_suite`)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from itertools import pairwise

from launcher.bench.summary import Sample, percentile, ratio


@dataclass
class DocAnswer:
    """One structured answer of a document pipeline: when it ended, whether it parsed, any error."""

    start: float
    end: float
    parsed: bool
    error: str | None = None


def chat_figures(samples: list[Sample], start: float, end: float) -> dict:
    """TTFT p50/p95, the longest pause inside a stream (and when it ended) and the median gap,
    output tok/s over the window [start, end], failures; of the chat samples that ended inside the
    window."""
    ok = [s for s in samples if s.ok and not s.cut]
    gaps = [g for s in ok for g in s.gaps]
    tokens = sum(s.tokens for s in ok)
    ends = [(b - a, b) for s in ok for a, b in pairwise(s.chunks)]
    return {
        "requests": len(ok),
        "failed": sum(1 for s in samples if s.error),
        "ttft_p50_s": percentile([s.ttft for s in ok], 50),
        "ttft_p95_s": percentile([s.ttft for s in ok], 95),
        "longest_pause_s": max(gaps, default=None),
        "longest_pause_ended_s": max(ends)[1] if ends else None,  # perf_counter: the run's wall_minus_perf_s dates it
        "median_gap_s": statistics.median(gaps) if gaps else None,
        "tokens_per_s": tokens / (end - start) if end > start else None,
    }


def doc_figures(answers: list[DocAnswer], per_doc: int, start: float, end: float) -> dict:
    """Documents per minute (a document counts when all ``per_doc`` of its answers came back) and
    the share of answers that parse."""
    done = sum(1 for a in answers if a.error is None) / per_doc
    return {
        "answers": len(answers),
        "failed": sum(1 for a in answers if a.error),
        "documents_per_min": 60 * done / (end - start) if end > start else None,
        "parsed_share": sum(a.parsed for a in answers) / len(answers) if answers else None,
        "errors_seen": sorted({a.error for a in answers if a.error})[:3],  # what the failures were
    }


def ratios(run: dict) -> dict:
    """The targets' ratios of one server's run: TTFT p95 beside / alone, longest pause / median gap."""
    alone, beside = run["chat_alone"], run["chat_beside"]
    return {
        "ttft_p95_beside_over_alone": ratio(beside["ttft_p95_s"], alone["ttft_p95_s"]),
        "longest_pause_over_median_gap": ratio(beside["longest_pause_s"], beside["median_gap_s"]),
    }


ROWS = (  # (label, section, key, unit scale, format)
    ("chat TTFT p50, alone", "chat_alone", "ttft_p50_s", 1000, "{:.0f} ms"),
    ("chat TTFT p95, alone", "chat_alone", "ttft_p95_s", 1000, "{:.0f} ms"),
    ("chat TTFT p50, beside the documents", "chat_beside", "ttft_p50_s", 1000, "{:.0f} ms"),
    ("chat TTFT p95, beside the documents", "chat_beside", "ttft_p95_s", 1000, "{:.0f} ms"),
    ("longest pause in a stream, beside", "chat_beside", "longest_pause_s", 1000, "{:.0f} ms"),
    ("median gap in a stream, beside", "chat_beside", "median_gap_s", 1000, "{:.0f} ms"),
    ("chat tokens/s, alone", "chat_alone", "tokens_per_s", 1, "{:.1f}"),
    ("chat tokens/s, beside", "chat_beside", "tokens_per_s", 1, "{:.1f}"),
    ("documents per minute", "documents", "documents_per_min", 1, "{:.2f}"),
    ("answers that parse", "documents", "parsed_share", 100, "{:.0f} %"),
    ("TTFT p95 beside / alone", "ratios", "ttft_p95_beside_over_alone", 1, "{:.2f}"),
    ("longest pause / median gap", "ratios", "longest_pause_over_median_gap", 1, "{:.2f}"),
)


def table_lines(runs: list[dict]) -> list[str]:
    """The printed table: one row per figure, one column per server (ours first)."""
    width = max(len(label) for label, *_ in ROWS) + 2
    head = "".ljust(width) + "".join(r["label"][:22].rjust(24) for r in runs)
    lines = [head]
    for label, section, key, scale, fmt in ROWS:
        cells = []
        for r in runs:
            value = r.get(section, {}).get(key)
            cells.append((fmt.format(value * scale) if value is not None else "-").rjust(24))
        lines.append(label.ljust(width) + "".join(cells))
    return lines
