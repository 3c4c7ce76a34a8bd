"""Model shapes the planning tests size: the public Llama-2 family and SmolLM2-135M."""

from __future__ import annotations

import json

from tests.helpers.deployment import free_port
from worker.contract.shapes import ModelShape, from_hf_config

# Public Llama-2 shapes (Meta's config.json files): hidden, layers, heads, kv heads, intermediate.
LLAMA2 = {
    "7B": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "intermediate_size": 11008},
    "13B": {"hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 40, "intermediate_size": 13824},
    "70B": {
        "hidden_size": 8192,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "intermediate_size": 28672,
    },
}


def llama2(size_name: str, **extra) -> ModelShape:
    return from_hf_config({**LLAMA2[size_name], "vocab_size": 32000, **extra}, f"llama-2-{size_name}")


SMOLLM2_135M = {
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}


def deploy_file(tmp_path, workers: dict, extra: str = "") -> str:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(SMOLLM2_135M))  # 9 heads, 3 KV heads, 1536 wide
    path = tmp_path / "deploy.yaml"
    path.write_text(
        f"model: {{name: {model}}}\n"
        f"router: {{port: {free_port()}, admin_port: {free_port()}}}\n"
        f"workers: {json.dumps(workers)}\n" + extra
    )
    return str(path)


MINILM_L6 = {  # sentence-transformers/all-MiniLM-L6-v2's config.json (the embedded embedding model)
    "architectures": ["BertModel"],
    "model_type": "bert",
    "hidden_size": 384,
    "num_hidden_layers": 6,
    "num_attention_heads": 12,
    "intermediate_size": 1536,
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
    "vocab_size": 30522,
}


def minilm_folder(parent) -> str:
    """A sentence-transformers folder of MiniLM's files without weights: config, modules (mean
    pooling, normalize) and ``max_seq_length`` 256, as the embedded model ships them."""
    folder = parent / "minilm"
    (folder / "1_Pooling").mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(MINILM_L6))
    modules = [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]
    (folder / "modules.json").write_text(
        json.dumps(
            [{"idx": i, "path": p, "type": f"sentence_transformers.models.{t}"} for i, (p, t) in enumerate(modules)]
        )
    )
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256}))
    return str(folder)
