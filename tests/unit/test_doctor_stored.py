"""``doctor``'s kernel row measures the weight format the worker loads: under ``quantization:
auto`` a GGUF file's stored types (the embedded default's Q4_1 layers and Q8_0 head), measured
with the worker's own kernel table (worker.quant.linear.Linears, its timing method)."""

from __future__ import annotations

from types import SimpleNamespace

from launcher.config import DeployConfig
from launcher.plan.doctor_kernels import kernel_check, stored_types
from launcher.plan.shape import read_shape
from worker.contract.shapes import GgufTypes


def tiny(types: GgufTypes | None):
    """A small Llama-shaped model (its weights are random here), stored as ``types``."""
    return SimpleNamespace(
        hidden_size=64,
        head_dim=32,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=128,
        vocab_size=256,
        gguf_types=types,
    )


def config(quantization: str) -> DeployConfig:
    return DeployConfig.model_validate({"model": {"quantization": quantization}, "workers": {"max_num_seqs": 2}})


def test_the_embedded_default_under_auto_is_measured_as_its_stored_types():
    cfg = config("auto")
    shape = read_shape(cfg.model.name, cfg.model)
    assert stored_types(cfg, shape) == {
        "qkv": "Q4_1",
        "o": "Q4_1",
        "gate_up": "Q4_1",
        "down": "Q4_1",
        "lm_head": "Q8_0",
    }
    assert stored_types(config("none"), shape) == {} and stored_types(config("int8"), shape) == {}


def test_the_kernel_row_names_the_stored_format_and_its_kernels():
    status, detail, _ = kernel_check(config("auto"), tiny(GgufTypes("Q4_1", "Q8_0")), "cpu", "float32")
    head, *rows = detail.splitlines()
    assert status == "ok" and "the file's Q4_1/Q8_0, as stored" in head, detail
    assert sum("Q4_1" in row for row in rows) == 4 and sum("Q8_0" in row for row in rows) == 1, detail
    status, detail, _ = kernel_check(config("auto"), tiny(None), "cpu", "float32")  # a float checkpoint
    assert status == "ok" and "as stored" not in detail and "Q4_1" not in detail, detail
