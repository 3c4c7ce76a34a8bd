"""Two models behind one endpoint (``models:``), one CPU replica each: SmolLM2 quantized to int8 at
load (``smollm2-int8``) and the shipped Q4_1 GGUF file served as stored (``smollm2-q4``).

The one deployment also carries what a deployment of each form alone used to check: the int8
worker's kernel table and weight memory, the GGUF worker's quantized matrices (no float copy).
Routing: each model answers the README's question, ``/v1/models`` lists both, an unknown model is
404 ``model_not_found``, ``GET /workers``, ``/metrics`` and the status page (headless Chromium)
name each replica's model, the chat page offers both, and a
restart of one model's replica leaves the other serving (last: it restarts a worker). A GGUF
file of a type without a native kernel is refused by ``up`` before anything starts.
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import numpy as np
import pytest
import yaml
from gguf import GGMLQuantizationType, GGUFWriter
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.browser import Browser, chromium_paths
from tests.helpers.deployment import Deployment, assert_openai_error, wait_for
from worker.quant import ggml_kernel

# Each worker times its kernel candidates at start (tens of seconds on a busy 2-core box) before it is ready.
pytestmark = pytest.mark.timeout(600)

INT8, Q4 = "smollm2-int8", "smollm2-q4"
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    # a fixed prefill budget: no calibration steps at start (they time the kernels, not this test's subject)
    config = {
        "models": [
            # bfloat16 compute, what dtype auto gives on a CPU with avx512_bf16: in float32, ggml's 8-bit
            # activations take the question's first-token near-tie ("The" 25.33, "L" 25.24) the other way
            {"served_name": INT8, "quantization": "int8", "dtype": "bfloat16"},
            {"served_name": Q4, "quantization": "auto"},
        ],
        "workers": {"replicas": 1, "max_prefill_tokens": 256},
        "router": {"request_timeout_s": 300},
    }
    d = Deployment(tmp_path_factory.mktemp("two-models"), config)
    try:
        yield d.start(timeout=540)
    finally:
        d.stop()  # also when the start times out: no processes left behind


def worker_of(d: Deployment, model: str) -> dict:
    (w,) = [w for w in d.workers() if w["model"] == model]
    return w


@pytest.mark.parametrize("model", [INT8, Q4])
def test_each_model_answers_the_readme_question(two, model):
    r = two.chat(QUESTION, max_tokens=16, model=model, timeout=300, logprobs=True, top_logprobs=2)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model
    choice = r.json()["choices"][0]
    if model == Q4:
        assert "Paris" in choice["message"]["content"], choice["message"]["content"]
    else:
        # int8 as Q8_0 with ggml's 8-bit activations (llama.cpp's own arithmetic) sits on the question's
        # first-token near-tie ("The" 25.33 against "L" 25.24 in float32): the kernels the worker's table
        # picks by timing decide the side, so the answer's path ("The capital of France is Paris.") must
        # be one of the two most likely first tokens, whichever was taken
        first = choice["logprobs"]["content"][0]
        assert "The" in [t["token"] for t in first["top_logprobs"]], first


def test_models_lists_both_and_an_unknown_model_is_404(two):
    listed = httpx.get(f"{two.base_url}/models", timeout=10).json()["data"]
    assert [(m["id"], m["task"]) for m in listed] == [(INT8, "generate"), (Q4, "generate")]
    r = two.chat(QUESTION, max_tokens=4, model="no-such-model")
    assert r.status_code == 404, r.text
    assert_openai_error(r.json(), "model_not_found")
    assert "no-such-model" in r.json()["error"]["message"] and INT8 in r.json()["error"]["message"]


def test_one_model_is_retrieved_by_its_id_as_the_openai_sdk_does(two):
    # the openai SDK's client.models.retrieve(id), LangChain4j's model check: GET /v1/models/{id}
    r = httpx.get(f"{two.base_url}/models/{Q4}", timeout=10)
    assert r.status_code == 200, r.text
    listed = httpx.get(f"{two.base_url}/models", timeout=10).json()["data"]
    assert r.json() == listed[1] and r.json()["id"] == Q4 and r.json()["object"] == "model"
    missing = httpx.get(f"{two.base_url}/models/no-such-model", timeout=10)
    assert missing.status_code == 404, missing.text
    assert_openai_error(missing.json(), "model_not_found")


def test_workers_and_metrics_name_each_replicas_model(two):
    assert sorted((w["id"], w["model"]) for w in two.workers()) == [(0, INT8), (1, Q4)]  # global ids, model order
    text = httpx.get(f"{two.url}/metrics", timeout=10).text
    ready = {
        (s.labels["worker_id"], s.labels["model"])
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "llamadeploy_worker_state" and s.labels["state"] == "ready" and s.value == 1
    }
    assert ready == {("0", INT8), ("1", Q4)}


def test_the_pages_show_each_replicas_model_and_offer_both_to_chat_with(two):
    chromium_paths()  # skips without a browser
    browser = Browser()
    try:
        browser.open(f"{two.url}/status")
        browser.wait(lambda: len(browser.find_all("#workers tbody tr")) == 2, 30, "a row per replica")
        rows = {
            r.get_attribute("data-worker"): r.find_element("css selector", "td[data-model]").text
            for r in browser.find_all("#workers tbody tr")
        }
        assert rows == {"0": INT8, "1": Q4}
        browser.open(f"{two.url}/")
        browser.wait(lambda: browser.find("#model").get_attribute("value"), 30, "the model list")
        picker = [o.get_attribute("value") for o in browser.find_all("#model option")]
        assert picker == [INT8, Q4]
        assert not browser.foreign_requests(two.url) and not browser.console_errors()
    finally:
        browser.quit()


def test_int8_worker_shows_its_kernel_table_and_weight_memory(two):
    w = worker_of(two, INT8)
    kernels = w["kernels"]
    # the linears and the LM head: Q8_0 blocks by ggml_quantize_chunk where set-up built the ggml kernels
    label = "Q8_0/g32" if ggml_kernel.load() else "int8/channel"
    assert {row["weight"] for row in kernels} == {label}
    assert sum(row["count"] for row in kernels) == 4 * 30 + 1  # SmolLM2: qkv, o, gate_up, down x 30, the head
    for row in kernels:
        assert [p["rows"] for p in row["picks"]][:4] == [1, 2, 4, 8]
        assert all(p["kernel"] and (p["ms"] is None or p["ms"] > 0) for p in row["picks"])
    # int8 SmolLM2-135M: ~106M linear values at 1 byte, the 28M-entry tied table as int8 rows, scales
    assert 100 * 2**20 < w["weight_bytes"] < 160 * 2**20
    assert f"kernels for 3072x576 {label} (30 weights)" in two.log()


def test_gguf_worker_keeps_its_weights_quantized(two):
    """The weight memory is the quantized size, and no quantized matrix runs from a float copy."""
    worker = worker_of(two, Q4)
    float32_bytes = 134_515_008 * 4  # SmolLM2-135M's parameters (tied LM head) in float32
    # below bfloat16's size whatever second forms the kernel table keeps (one Q4_1 form alone is ~0.2x float32)
    assert 0 < worker["weight_bytes"] < 0.5 * float32_bytes, worker["weight_bytes"]
    counts: dict[str, int] = {}
    for k in worker["kernels"]:
        counts[k["weight"]] = counts.get(k["weight"], 0) + k["count"]
    assert counts == {"Q4_1/g32": 30 * 4, "Q8_0/g32": 1}  # per layer qkv, o, gate_up, down; the tied LM head
    for k in worker["kernels"]:
        assert not any(p["kernel"].startswith(("float-copy", "plain", "onednn")) for p in k["picks"]), k


def test_unservable_type_refused_before_start(tmp_path):
    path = tmp_path / "q6.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((4, 210), dtype=np.uint8), raw_dtype=GGMLQuantizationType.Q6_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cfg = {"model": {"name": str(path)}, "workers": {"devices": "cpu", "replicas": 1}}
    (tmp_path / "deploy.yaml").write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "launcher.cli", "up", str(tmp_path / "deploy.yaml")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    out = " ".join((done.stdout + done.stderr).split())
    assert "Q6_K" in out and "model.quantization: none" in out


def test_restarting_one_models_replica_leaves_the_other_serving(two):
    """Last of the deployment's tests: ``restart-worker`` of the int8 replica (the deployment ends
    while it reloads); the Q4 replica answers meanwhile and was never touched."""
    before = worker_of(two, INT8)
    cmd = [sys.executable, "-m", "launcher.cli", "restart-worker", str(before["id"]), "--no-wait"]
    done = subprocess.run([*cmd, "--config", str(two.path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"worker {before['id']} ({INT8}) restarting" in done.stdout + done.stderr  # the console: stderr
    wait_for(lambda: worker_of(two, INT8)["pid"] != before["pid"], 60, what="the int8 replica's new process")
    assert worker_of(two, INT8)["state"] != "ready"  # loading: it takes no request
    answer = two.chat(QUESTION, max_tokens=16, model=Q4, timeout=300)
    assert answer.status_code == 200, answer.text
    assert "Paris" in answer.json()["choices"][0]["message"]["content"]
    q4 = worker_of(two, Q4)
    assert q4["state"] == "ready" and q4["restarts"] == 0
