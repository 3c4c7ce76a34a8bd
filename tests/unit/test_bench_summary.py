"""The bench's figures over synthetic timelines: tok/s, TTFT p50/p95, ITL, the closed-loop window,
the stall gap and its ratio (and what the stall's streams send), the engine table's ratios and the
ours/peer comparison's direction."""

from __future__ import annotations

import asyncio
import time

import pytest

from launcher.bench import load
from launcher.bench.client import on_line
from launcher.bench.figures import BY_KEY, compare, engine_figures, meets
from launcher.bench.prompts import report_text, special_token_bias
from launcher.bench.summary import Sample, batch_summary, percentile, stall_summary, summarize


def sample(
    start: float,
    chunks: list[float],
    end: float | None = None,
    tokens: int | None = None,
    kind: str = "measured",
    error: str | None = None,
) -> Sample:
    return Sample(
        kind,
        start,
        list(chunks),
        end if end is not None else (chunks[-1] if chunks else start),
        completion_tokens=tokens,
        error=error,
    )


def test_percentile_is_nearest_rank_and_none_when_empty():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([3.0, 1.0, 2.0], 95) == 3.0
    assert percentile([5.0], 95) == 5.0
    assert percentile(list(range(101)), 95) == 95


def test_one_after_another_tok_s_ttft_and_itl():
    samples = [
        sample(0.0, [0.1, 0.2, 0.3], 0.35, tokens=4),
        sample(0.4, [0.6, 0.7], 0.8, tokens=2),
        sample(0.8, [1.1, 1.15, 1.2], 1.25, tokens=3),
    ]
    s = batch_summary(samples)
    assert s["requests"] == 3 and s["failures"] == 0
    assert s["output_tokens_per_s"] == pytest.approx(9 / 1.25)  # all tokens over first start → last end
    assert s["ttft_p50_s"] == pytest.approx(0.2) and s["ttft_p95_s"] == pytest.approx(0.3)
    # gaps: 0.1, 0.1, 0.1, 0.05, 0.05 → median 0.1
    assert s["itl_p50_s"] == pytest.approx(0.1)
    assert s["e2e_p50_s"] == pytest.approx(0.4)
    assert s["mean_output_tokens"] == 3


def test_failed_and_empty_requests_are_failures_and_do_not_count_tokens():
    samples = [
        sample(0.0, [0.5], 1.0, tokens=8),
        sample(0.0, [], 0.2, error="HTTP 503: busy"),
        sample(0.0, [], 0.3),
    ]  # streamed nothing with content
    s = batch_summary(samples)
    assert s["failures"] == 2 and s["errors"] == ["HTTP 503: busy"]
    assert s["output_tokens_per_s"] == pytest.approx(8.0)
    assert batch_summary([sample(0.0, [], 0.2, error="x")])["output_tokens_per_s"] is None


def test_tokens_fall_back_to_chunk_count_without_usage():
    s = batch_summary([sample(0.0, [0.25, 0.5, 0.75, 1.0])])
    assert s["output_tokens_per_s"] == pytest.approx(4.0) and s["mean_output_tokens"] is None


def test_closed_loop_window_counts_only_chunks_inside_it():
    samples = [
        sample(0.0, [0.5, 1.5], 1.5, tokens=2, kind="warmup"),  # one chunk inside [1, 3]
        sample(1.0, [2.0, 3.0], 3.0, tokens=4),  # two chunks of two tokens each, both inside
        sample(1.6, [2.5, 3.5], 3.5, tokens=2, kind="filler"),
    ]  # one inside
    s = summarize(samples, 1.0, 3.0, output_tokens=2)
    assert s["requests"] == 1 and s["window_s"] == 2.0
    assert s["output_tokens_per_s"] == pytest.approx((1 + 4 + 1) / 2.0)
    assert s["requests_per_s"] == pytest.approx((0.5 + 1 + 0.5) / 2.0)
    assert s["ttft_p50_s"] == pytest.approx(1.0)  # measured requests only


def test_stall_is_the_longest_gap_over_the_prefill_against_the_median_gap():
    steady = [i * 0.05 for i in range(1, 21)]  # 50 ms apart until 1.0 s
    after = [1.6 + i * 0.05 for i in range(10)]  # the document prefills from 1.02 s to 1.5 s
    streams = [
        sample(0.0, steady + after, kind="stream"),
        sample(0.0, [*steady, 1.55, *after[1:]], kind="stream"),
        sample(0.0, steady[:5], 0.3, kind="stream"),
    ]  # ended before the document
    doc = sample(1.02, [1.5, 1.6], 1.7, tokens=2, kind="doc")
    s = stall_summary(streams, doc)
    assert s["prefill_s"] == pytest.approx(0.48)
    assert s["max_gap_s"] == pytest.approx(0.6) and s["median_gap_s"] == pytest.approx(0.05)
    assert s["gap_ratio"] == pytest.approx(12.0)
    assert s["spanning"] == 2 and s["streams"] == 3


def test_stall_without_a_document_answer_has_no_figures():
    s = stall_summary([sample(0.0, [0.1, 0.2])], sample(0.0, [], 0.5, error="HTTP 400: too long"))
    assert s["gap_ratio"] is None and s["error"] == "HTTP 400: too long"


def test_engine_figures_and_their_ratios():
    details = {
        "c1": {"output_tokens_per_s": 24.0, "ttft_p50_s": 0.1},
        "closed_loop": {"output_tokens_per_s": 120.0, "ttft_p50_s": 0.3},
        "burst": {"ttft_p50_s": 0.5},
        "doc": {"ttft_p50_s": 3.0},
        "doc_again": {"ttft_p50_s": 0.3},
        "stall": {"max_gap_s": 2.0, "gap_ratio": 40.0},
    }
    f = engine_figures(details)
    assert f["burst_vs_c1_ttft"] == pytest.approx(5.0) and f["doc_again_ratio"] == pytest.approx(0.1)
    assert f["stall_gap_ratio"] == 40.0 and "json_tok_s" not in f
    assert meets(BY_KEY["burst_vs_c1_ttft"], f["burst_vs_c1_ttft"]) is False
    assert meets(BY_KEY["doc_again_ratio"], f["doc_again_ratio"]) is True
    assert meets(BY_KEY["c1_tok_s"], f["c1_tok_s"]) is None  # no target of its own
    f = engine_figures({**details, "json": {"output_tokens_per_s": 12.0}})
    assert f["json_vs_plain_tok_s"] == pytest.approx(0.5)
    assert engine_figures({})["burst_vs_c1_ttft"] is None


def test_compare_knows_which_way_is_better():
    ours = {"c1_tok_s": 50.0, "c1_ttft_p50_s": 0.1, "doc_ttft_s": 2.0, "stall_gap_ratio": None}
    peer = {"c1_tok_s": 100.0, "c1_ttft_p50_s": 0.2, "doc_ttft_s": 2.0, "stall_gap_ratio": 1.5}
    rows = {c.figure.key: c for c in compare(ours, peer)}
    assert set(rows) == {"c1_tok_s", "c1_ttft_p50_s", "doc_ttft_s"}  # unmeasured figures are skipped
    assert rows["c1_tok_s"].ratio == pytest.approx(0.5) and rows["c1_tok_s"].verdict == "peer ahead 2.00x"
    assert rows["c1_ttft_p50_s"].ratio == pytest.approx(0.5) and rows["c1_ttft_p50_s"].verdict == "ours ahead 2.00x"
    assert rows["doc_ttft_s"].verdict == "even"


def test_ttft_is_the_first_chunk_with_content():
    s = Sample("c1", 0.0)
    for line in [
        'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":null}}]}',
        'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}',
        "",
        ": keep-alive",
        'data:{"choices":[{"index":0,"delta":{"content":"Hi"}}]}',
        'data: {"choices":[],"usage":{"prompt_tokens":30,"completion_tokens":5}}',
        "data: [DONE]",
    ]:
        on_line(line, s)
    assert len(s.chunks) == 1 and s.completion_tokens == 5 and s.prompt_tokens == 30


def test_the_document_text_does_not_repeat_itself():
    text = report_text(1, 200)
    sentences = [x.strip() for x in text.replace("\n", " ").split(". ") if x.strip()]
    assert len(sentences) > 150 and len(set(sentences)) / len(sentences) > 0.95
    assert report_text(1, 50) == report_text(1, 50) != report_text(2, 50)


def test_an_answer_counted_but_not_streamed_counts_tokens_without_a_ttft():
    s = batch_summary([sample(0.0, [], 1.0, tokens=8), sample(1.0, [1.5, 2.0], 2.0, tokens=2)])
    assert s["failures"] == 0 and s["output_tokens_per_s"] == pytest.approx(10 / 2.0)
    assert s["ttft_p50_s"] == pytest.approx(0.5)


def test_the_compare_table_labels_direction_and_verdict():
    from rich.console import Console

    from launcher.bench.report import engine_table

    ours = {
        "label": "ours",
        "base_url": "u",
        "options": {"clients": 8},
        "figures": {"c1_tok_s": 50.0, "doc_ttft_s": 1.0},
    }
    peer = {"label": "peer", "figures": {"c1_tok_s": 100.0, "doc_ttft_s": 2.0}}
    console = Console(width=250, record=True)
    console.print(engine_table(ours, [peer]))
    text = console.export_text()
    c1 = next(line for line in text.splitlines() if "c1 (one after another)" in line)
    doc = next(line for line in text.splitlines() if "doc alone" in line)
    assert "0.50" in c1 and "higher" in c1 and "peer ahead 2.00x" in c1 and "≥ 1" in c1
    assert "0.50" in doc and "lower" in doc and "ours ahead 2.00x" in doc


def test_the_affinity_bench_line_gives_the_mean_repeat_against_the_first():
    from launcher.bench.affinity import document, summary

    line = summary("round_robin", 1478, [0.9, 0.9, 0.1, 0.1])
    assert line.endswith("latencies 0.90 0.90 0.10 0.10 s; repeats / first = 0.41x")
    assert document("a") != document("b") and document("a") == document("a")


class _Tokenizer:
    all_special_ids = (2, 0, 1, 2)


def test_the_stall_streams_ban_the_special_tokens_as_llama_cpp_does_under_ignore_eos():
    assert special_token_bias(_Tokenizer()) == {"0": -100, "1": -100, "2": -100}


class _StreamingClient:
    """Streams a chunk every millisecond until cancelled; the document answers at once."""

    def __init__(self, doc: list[dict]):
        self.doc, self.bodies = doc, []

    async def send(self, messages: list[dict], s: Sample, **overrides) -> Sample:
        self.bodies.append((messages, overrides))
        s.chunks.append(time.perf_counter())
        if messages is self.doc:
            s.end = time.perf_counter()
            return s
        while True:
            await asyncio.sleep(0.001)
            s.chunks.append(time.perf_counter())


def test_every_stall_stream_carries_its_body_and_the_document_does_not():
    doc = [{"role": "user", "content": "a long document"}]
    client = _StreamingClient(doc)
    prompts = [[{"role": "user", "content": f"q{i}"}] for i in range(3)]
    body = {"max_tokens": 64, "logit_bias": {"2": -100}}
    streams, got = asyncio.run(load.document_among_streams(client, prompts, body, doc, 16, timeout=10))
    assert got.chunks and all(s.chunks[-1] > got.chunks[0] for s in streams)
    assert [o for m, o in client.bodies if m is not doc] == [body] * 3
    assert [o for m, o in client.bodies if m is doc] == [{"max_tokens": 16}]
