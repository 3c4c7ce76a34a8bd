"""The serving worker's kernel table beside the bench figures (``launcher.bench.kernels``): read
from ``GET /workers``, absent for a peer without it, printed one line per weight shape."""

from __future__ import annotations

import httpx

from launcher.bench import kernels
from launcher.bench.kernels import kernel_lines, server_kernels
from launcher.bench.report import engine_lines

TABLE = [
    {
        "n": 576,
        "k": 576,
        "weight": "Q8_0/g32",
        "count": 60,
        "picks": [{"rows": 1, "kernel": "ggml", "ms": 0.0312}, {"rows": 64, "kernel": "int8pack-bf16", "ms": 0.9}],
    },
    {"n": 49152, "k": 576, "weight": "Q8_0/g32", "count": 1, "picks": [{"rows": 512, "kernel": "ggml", "ms": None}]},
]


def answer(monkeypatch, status: int, body) -> list[str]:
    """Make ``httpx.get`` answer ``status`` with ``body`` (JSON, or text when a str); returns the URLs asked."""
    asked = []

    def get(url, **_):
        asked.append(url)
        if isinstance(body, Exception):
            raise body
        return httpx.Response(status, text=body) if isinstance(body, str) else httpx.Response(status, json=body)

    monkeypatch.setattr(kernels.httpx, "get", get)
    return asked


def test_the_first_ready_worker_with_a_table_gives_it(monkeypatch):
    workers = [
        {"id": 0, "state": "starting", "kernels": []},
        {"id": 1, "state": "ready", "kernels": []},  # an embedding worker reports none
        {"id": 2, "state": "ready", "kernels": TABLE},
    ]
    asked = answer(monkeypatch, 200, {"policy": "least_loaded", "accepting": True, "workers": workers})
    assert server_kernels("http://127.0.0.1:8000/v1/", None) == TABLE
    assert asked == ["http://127.0.0.1:8000/workers"]


def test_a_peer_without_the_endpoint_has_no_table(monkeypatch):
    answer(monkeypatch, 404, "File Not Found")
    assert server_kernels("http://127.0.0.1:8400/v1", None) is None
    answer(monkeypatch, 200, "<html>not json</html>")
    assert server_kernels("http://127.0.0.1:8400/v1", None) is None
    answer(monkeypatch, 200, ["not", "a", "table"])
    assert server_kernels("http://127.0.0.1:8400/v1", None) is None
    answer(monkeypatch, 0, httpx.ConnectError("refused"))
    assert server_kernels("http://127.0.0.1:8400/v1", None) is None


def test_one_line_per_weight_shape_with_each_bucket_and_its_time():
    lines = kernel_lines(TABLE)
    assert lines[0].startswith("kernel table of the serving worker")
    assert lines[1] == "  576×576 Q8_0/g32 ×60: ≤1 ggml 0.031ms, ≤64 int8pack-bf16 0.900ms"
    assert lines[2] == "  49152×576 Q8_0/g32 ×1: ≤512 ggml"  # the only eligible kernel was not timed
    assert kernel_lines(None) == [] and kernel_lines([]) == []


def test_the_engine_notes_end_with_the_table_and_a_peer_run_has_none():
    result = {"details": {}, "prompt_tokens": {}, "figures": {}, "kernels": TABLE}
    assert engine_lines(result)[-3:] == kernel_lines(TABLE)
    peer = {"details": {}, "prompt_tokens": {}, "figures": {}, "kernels": None}
    assert not any("kernel table" in line for line in engine_lines(peer))
