"""``llamadeploy bench --suite engine --embedding-load C``'s pure parts: the option, the ratios and
their verdicts, the printed lines, the steady embedding load's counting."""

from __future__ import annotations

import asyncio

import pytest
import typer

from launcher.bench.beside import SteadyEmbeddings, compared, lines
from launcher.bench.command import bench_options

GIVEN = {"scenario": ["chat"], "extra_body": "{}", "response_format": None, "compare": [], "concurrency": "1,8"}


def test_the_embedding_load_is_an_engine_suite_option():
    opts = bench_options({**GIVEN, "suite": "engine", "embedding_load": 4, "embedding_model": "minilm"})
    assert (opts.embedding_load, opts.embedding_model) == (4, "minilm")
    with pytest.raises(typer.BadParameter, match="--suite engine"):
        bench_options({**GIVEN, "suite": "embed", "embedding_load": 4})


def test_ratios_are_with_load_over_alone_and_judged_by_which_way_is_better():
    alone = {"c1_tok_s": 100.0, "c1_ttft_p50_s": 0.050, "closed_loop_tok_s": 400.0, "closed_loop_ttft_p50_s": 0.1}
    loaded = {"c1_tok_s": 95.0, "c1_ttft_p50_s": 0.056, "closed_loop_tok_s": 340.0, "closed_loop_ttft_p50_s": None}
    rows = {r["key"]: r for r in compared(alone, loaded)}
    assert rows["c1_tok_s"]["ratio"] == pytest.approx(0.95) and rows["c1_tok_s"]["within"] is True
    assert rows["c1_ttft_p50_s"]["ratio"] == pytest.approx(1.12) and rows["c1_ttft_p50_s"]["within"] is False
    assert rows["closed_loop_tok_s"]["within"] is False  # 0.85: more than 10% slower
    assert rows["closed_loop_ttft_p50_s"]["ratio"] is None and rows["closed_loop_ttft_p50_s"]["within"] is None


def test_the_printed_lines_show_both_values_the_ratio_and_the_load():
    alone = {"c1_tok_s": 100.0, "c1_ttft_p50_s": 0.050}
    loaded = {"c1_tok_s": 95.0, "c1_ttft_p50_s": 0.0505}
    result = {
        "label": "ours",
        "model": "chat",
        "embedding_model": "minilm",
        "base_url": "http://x/v1",
        "embedding_load": {"clients": 4, "inputs_per_s": 123.4, "errors": 0},
        "ratios": compared(alone, loaded),
    }
    out = lines(result)
    assert "beside 4 embedding clients (minilm)" in out[0]
    assert any(line.startswith("c1: output tok/s ") and "0.95×  yes" in line for line in out)
    assert not any("tok/s ms" in line for line in out)  # only latencies are shown in ms
    assert any(line.startswith("c1: TTFT p50 ms") and "50.0" in line and "1.01×  yes" in line for line in out)
    assert any(line.startswith("closed loop: output tok/s") and line.endswith("-") for line in out)
    assert out[-1] == "embedding load during the chat part: 123.4 inputs/s, 0 errors"


class CountingClient:
    """Answers every request at once; every third one fails."""

    def __init__(self):
        self.sent: list[str] = []

    async def send(self, text: str):
        self.sent.append(text)
        await asyncio.sleep(0)
        return 0.0, ("HTTP 429" if len(self.sent) % 3 == 0 else None)


def test_the_steady_load_runs_every_client_until_stopped_and_counts_answers_and_errors():
    async def scenario():
        client = CountingClient()
        steady = SteadyEmbeddings(client, clients=3)
        steady.start()
        await steady.wait_flowing(timeout=5)
        await asyncio.sleep(0.01)
        await steady.stop()
        return client, steady

    client, steady = asyncio.run(scenario())
    assert steady.served + len(steady.errors) == len(client.sent) >= 6
    assert steady.errors and steady.served
    assert len(set(client.sent[:3])) == 3  # each client its own sentences
