"""The model a bench asks for when none is given: the first of ``GET /models`` that generates."""

from __future__ import annotations

from launcher.bench.client import first_generative


def test_bench_requests_the_first_model_that_generates():
    ours = {"data": [{"id": "minilm", "task": "embed"}, {"id": "chat", "task": "generate"}]}
    assert first_generative(ours) == "chat"
    assert first_generative({"data": [{"id": "peer-model"}]}) == "peer-model"  # a peer's list has no task
    assert first_generative({"data": [{"id": "minilm", "task": "embed"}]}) is None
