"""The shipped GGUF file served as stored (``model.quantization: auto``): its Q4_1 matrices and Q8_0
embedding stay quantized in the worker, and it answers over HTTP. A file of a type without a native
kernel is refused by ``up`` before anything starts."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import yaml
from gguf import GGMLQuantizationType, GGUFWriter

from tests.helpers.deployment import Deployment

# The worker times its kernel candidates at start (tens of seconds on a busy 2-core box) before it is ready.
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    # a fixed prefill budget: no calibration steps at start (they time the kernels, not this test's subject)
    workers = {"replicas": 1, "max_prefill_tokens": 256}
    config = {"model": {"quantization": "auto"}, "workers": workers, "router": {"request_timeout_s": 300}}
    d = Deployment(tmp_path_factory.mktemp("gguf-native"), config)
    try:
        yield d.start(timeout=420)
    finally:
        d.stop()  # also when the start times out: no processes left behind


def test_shipped_q4_1_answers_paris(native):
    r = native.chat("What is the capital of France?", max_tokens=16, timeout=300)
    assert r.status_code == 200, r.text
    assert "Paris" in r.json()["choices"][0]["message"]["content"]


def test_weights_stay_quantized(native):
    """GET /workers: the weight memory is the quantized size, and no quantized matrix runs from a float copy."""
    worker = native.workers()[0]
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
