"""The one KV-cache formula (``worker.contract.shapes.kv_bytes_per_token``), torch-free."""

from __future__ import annotations

from worker.contract.shapes import kv_bytes_per_token


def test_kv_bytes_per_token_of_published_shapes():
    assert kv_bytes_per_token(80, 8, 128, 2) == 320 * 1024  # Llama-2-70B, 16-bit, GQA
    assert kv_bytes_per_token(32, 32, 128, 2) == 512 * 1024  # Llama-2-7B, 16-bit
    assert kv_bytes_per_token(30, 3, 64, 4) == 2 * 30 * 3 * 64 * 4  # SmolLM2-135M, float32


def test_a_shape_keeps_its_architecture_so_tensor_parallelism_can_refuse_before_start():
    from worker.contract.shapes import from_hf_config
    from worker.contract.tp_rules import tp_problems

    base = {"hidden_size": 768, "num_hidden_layers": 2, "num_attention_heads": 12, "intermediate_size": 3072}
    gpt2 = from_hf_config({**base, "vocab_size": 50257, "architectures": ["GPT2LMHeadModel"]})
    assert gpt2.architectures == ("GPT2LMHeadModel",)
    [line] = tp_problems(gpt2, 2)
    assert line.startswith("workers.tensor_parallel_size: 2 needs a Llama-family model") and line.endswith("use 1")
    llama = from_hf_config({**base, "vocab_size": 32000, "architectures": ["LlamaForCausalLM"]})
    assert tp_problems(llama, 2) == []
    assert from_hf_config({**base, "vocab_size": 32000}).architectures is None  # nothing said: only divisibility
