"""The bench's mixed suite without a server: its documents, questions and figures
(launcher/bench/mixed_docs.py, mixed_figures.py) and its options."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.bench.command import bench_options
from launcher.bench.mixed_docs import QUESTIONS, documents, parses, question_body
from launcher.bench.mixed_figures import DocAnswer, chat_figures, doc_figures, ratios, table_lines
from launcher.bench.mixed_suite import URL
from launcher.bench.summary import Sample


def stream(start: float, chunks: list[float], tokens: int | None = None) -> Sample:
    return Sample("measured", start, chunks=chunks, end=chunks[-1], completion_tokens=tokens or len(chunks))


def test_documents_are_real_package_descriptions_cut_to_length_in_name_order():
    docs = documents(3, 2000)
    names = [name for name, _ in docs]
    assert all(len(text) == 2000 for _, text in docs) and len(set(names)) == 3 and names == sorted(names)
    many = documents(1000, 2000)  # more than are installed: repeated in order
    assert len(many) == 1000 and many[0] == docs[0]
    with pytest.raises(RuntimeError):
        documents(1, 10**9)


def test_each_question_is_greedy_and_constrained_by_its_schema_and_answers_are_checked():
    body = question_body("m", "Some text.", 1, 160)
    assert body["model"] == "m" and body["temperature"] == 0 and body["max_tokens"] == 160
    assert body["response_format"]["json_schema"]["schema"] == QUESTIONS[1][2]
    assert "Some text." in body["messages"][0]["content"]
    assert parses('{"title": "t", "summary": "s"}', 0) and not parses('{"title": "t"}', 0)
    assert parses('{"keywords": ["a"]}', 1) and not parses("not json", 1) and not parses(None, 1)


def test_chat_figures_take_ttft_the_longest_pause_and_tokens_per_second():
    samples = [stream(0.0, [0.1, 0.2, 0.3]), stream(1.0, [1.5, 1.6, 2.6], tokens=6)]
    samples.append(Sample("beside", 3.0, error="HTTP 500"))
    got = chat_figures(samples, 0.0, 3.0)
    assert got["requests"] == 2 and got["failed"] == 1
    assert got["ttft_p50_s"] == pytest.approx(0.1) and got["ttft_p95_s"] == pytest.approx(0.5)
    assert got["longest_pause_s"] == pytest.approx(1.0) and got["median_gap_s"] == pytest.approx(0.1)
    assert got["longest_pause_ended_s"] == 2.6  # the chunk that ended it
    assert got["tokens_per_s"] == pytest.approx(3.0)


def test_document_figures_count_documents_whose_answers_all_came_back():
    answers = [DocAnswer(0, 10, True), DocAnswer(10, 20, False), DocAnswer(20, 30, True), DocAnswer(30, 40, True)]
    got = doc_figures(answers, per_doc=2, start=0.0, end=60.0)
    assert got["documents_per_min"] == pytest.approx(2.0) and got["parsed_share"] == pytest.approx(0.75)
    failed = doc_figures([DocAnswer(0, 1, False, "HTTP 400")], 2, 0.0, 60.0)
    assert failed["failed"] == 1 and failed["documents_per_min"] == 0


def test_ratios_and_the_table_show_each_server_side_by_side():
    run = {
        "label": "ours",
        "chat_alone": {"ttft_p95_s": 0.1},
        "chat_beside": {"ttft_p95_s": 0.25, "longest_pause_s": 0.3, "median_gap_s": 0.1},
        "documents": {"documents_per_min": 5.5, "parsed_share": 1.0},
    }
    run["ratios"] = ratios(run)
    assert run["ratios"]["ttft_p95_beside_over_alone"] == pytest.approx(2.5)
    assert run["ratios"]["longest_pause_over_median_gap"] == pytest.approx(3.0)
    lines = table_lines([run, {"label": "llama-server"}])
    assert "ours" in lines[0] and "llama-server" in lines[0]
    p95 = next(line for line in lines if line.startswith("chat TTFT p95, beside"))
    assert "250 ms" in p95 and p95.rstrip().endswith("-")


def test_the_mixed_suite_is_a_suite_and_a_compare_url_survives_a_path():
    opts = bench_options(
        {
            "suite": "mixed",
            "scenario": ["chat"],
            "extra_body": "{}",
            "response_format": None,
            "compare": ["http://127.0.0.1:8080/v1"],
            "concurrency": "1",
            "pipelines": 3,
            "chat_clients": 2,
        }
    )
    assert (opts.suite, opts.pipelines, opts.chat_clients, opts.answer_tokens) == ("mixed", 3, 2, 160)
    mangled = str(Path("http://127.0.0.1:8080/v1"))  # how typer hands a --compare URL over
    assert URL.sub(r"\1://", mangled) == "http://127.0.0.1:8080/v1"
