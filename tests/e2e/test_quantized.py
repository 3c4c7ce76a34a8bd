"""A deployment with ``model.quantization: int8``: the README's question through HTTP, and the kernel
table and weight memory the worker measured at start in ``GET /workers`` and its log."""

from __future__ import annotations

import pytest

from tests.helpers.deployment import Deployment


@pytest.fixture(scope="module")
def int8(tmp_path_factory):
    d = Deployment(
        tmp_path_factory.mktemp("int8"),
        {"model": {"quantization": "int8"}, "workers": {"replicas": 1}, "supervisor": {"router_standby": False}},
    )
    d.start(timeout=400)
    yield d
    d.stop()


def test_int8_answers_the_readme_question(int8):
    r = int8.chat("What is the capital of France?", max_tokens=50)
    assert r.status_code == 200, r.text
    assert "Paris" in r.json()["choices"][0]["message"]["content"]


def test_workers_show_the_kernel_table_and_the_weight_memory(int8):
    (w,) = int8.workers()
    kernels = w["kernels"]
    assert {row["weight"] for row in kernels} == {"int8/channel"}  # the linears and the LM head
    assert sum(row["count"] for row in kernels) == 4 * 30 + 1  # SmolLM2: qkv, o, gate_up, down x 30, the head
    for row in kernels:
        assert [p["rows"] for p in row["picks"]][:4] == [1, 2, 4, 8]
        assert all(p["kernel"] and (p["ms"] is None or p["ms"] > 0) for p in row["picks"])
    # int8 SmolLM2-135M: ~106M linear values at 1 byte, the 28M-entry tied table as int8 rows, scales
    assert 100 * 2**20 < w["weight_bytes"] < 160 * 2**20
    assert "kernels for 3072x576 int8/channel (30 weights)" in int8.log()
