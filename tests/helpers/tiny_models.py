"""A tiny random-initialised Llama for tests that need several model processes on two cores:
SmolLM2's config shape shrunk (hidden 64, 4 heads, 2 KV heads, MLP 128) with SmolLM2's tokenizer
and chat template, loaded with ``model.random_init`` (no weights file)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "vocab_size": 49152,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def write_tiny_llama(folder: Path, smollm: Path, **overrides) -> Path:
    """Write the tiny Llama's config.json (``overrides`` replace its keys) and SmolLM2's tokenizer
    files (from the resolved model folder ``smollm``) into ``folder``; returns ``folder``."""
    (folder / "config.json").write_text(json.dumps({**TINY_LLAMA, **overrides}))
    for name in TOKENIZER_FILES:
        if (smollm / name).exists():
            shutil.copy(smollm / name, folder / name)
    return folder
