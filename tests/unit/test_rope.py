"""worker/rope.py's tables equal transformers' LlamaRotaryEmbedding's, bit for bit, for every RoPE
type, below and beyond the model's max_position_embeddings (where dynamic NTK and LongRoPE change)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from worker.rope import rope_tables

MAX = 256  # the configs' max_position_embeddings
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "smollm2": {"rope_type": "default", "rope_theta": 100000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
    "longrope": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + i / 100 for i in range(16)],
        "long_factor": [2.0 + i / 10 for i in range(16)],
        "original_max_position_embeddings": 64,
    },
}


def config(rope: dict) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=1,
        intermediate_size=256,
        vocab_size=64,
        max_position_embeddings=MAX,
        rope_parameters=dict(rope),
    )


def library(cfg: LlamaConfig, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    rope = LlamaRotaryEmbedding(cfg)
    cos, sin = rope(torch.empty(0, dtype=torch.float32), torch.arange(positions)[None, :])
    return cos[0].float(), sin[0].float()


@pytest.mark.parametrize("positions", [48, MAX, 3 * MAX])
@pytest.mark.parametrize("name", list(ROPES))
def test_tables_equal_llama_rotary_embedding(name, positions):
    cfg = config(ROPES[name])
    cos, sin = rope_tables(cfg, positions, torch.device("cpu"))
    want_cos, want_sin = library(cfg, positions)
    assert cos.shape == (positions, 32) and cos.dtype == torch.float32
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)


def test_the_scaled_types_differ_from_the_default():
    """The cases above compare different tables, not one table seven times."""
    base, _ = rope_tables(config(ROPES["default"]), 3 * MAX, torch.device("cpu"))
    for name in ("linear", "dynamic", "llama3", "yarn", "longrope"):
        cos, _ = rope_tables(config(ROPES[name]), 3 * MAX, torch.device("cpu"))
        assert not torch.equal(cos, base), name


def test_tables_are_made_without_importing_modeling_llama():
    code = (
        "import sys, torch; from transformers import LlamaConfig; from worker.rope import rope_tables; "
        "rope_tables(LlamaConfig(), 16, torch.device('cpu')); "
        "print('transformers.models.llama.modeling_llama' in sys.modules, 'torch._dynamo' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["False", "False"]
