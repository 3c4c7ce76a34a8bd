"""``llamadeploy bench --suite embed``'s pure parts: its inputs, its option, its comparison lines."""

from __future__ import annotations

from launcher.bench.command import bench_options
from launcher.bench.embed_suite import compared, sentences
from launcher.bench.options import SUITES


def test_inputs_are_distinct_one_sentence_texts_the_same_every_run():
    texts = sentences(512)
    assert len(set(texts)) == 512 and texts == sentences(512)
    assert all(t.endswith(".") and len(t.split()) < 12 for t in texts)


def test_the_suite_is_an_option():
    assert "embed" in SUITES
    given = {"suite": "embed", "scenario": ["chat"], "extra_body": "{}", "response_format": None, "compare": []}
    assert bench_options({**given, "concurrency": "1,8,64"}).suite == "embed"


def test_comparison_lines_are_ours_over_theirs_per_level_and_for_the_batch():
    ours = {
        "label": "ours",
        "levels": [{"concurrency": 8, "inputs_per_s": 300.0}, {"concurrency": 64, "inputs_per_s": 500.0}],
        "batch": {"inputs_per_s": 900.0},
    }
    theirs = {
        "label": "peer",
        "levels": [{"concurrency": 8, "inputs_per_s": 200.0}, {"concurrency": 64, "inputs_per_s": None}],
        "batch": {"inputs_per_s": 450.0},
    }
    assert compared(ours, [theirs]) == [
        "c8: ours / peer inputs/s = 1.50×",
        "batch of 512: ours / peer inputs/s = 2.00×",
    ]
