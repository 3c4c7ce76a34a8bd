"""The one KV-cache formula (``launcher.shapes.kv_bytes_per_token``), torch-free."""

from __future__ import annotations

from launcher.shapes import kv_bytes_per_token


def test_kv_bytes_per_token_of_published_shapes():
    assert kv_bytes_per_token(80, 8, 128, 2) == 320 * 1024  # Llama-2-70B, 16-bit, GQA
    assert kv_bytes_per_token(32, 32, 128, 2) == 512 * 1024  # Llama-2-7B, 16-bit
    assert kv_bytes_per_token(30, 3, 64, 4) == 2 * 30 * 3 * 64 * 4  # SmolLM2-135M, float32
