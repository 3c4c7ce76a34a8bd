"""Loading one model replica onto this process's device.

The launcher has already resolved ``model_path`` to a local Hugging Face folder (config.json,
safetensors, tokenizer files) and set ``CUDA_VISIBLE_DEVICES`` before this process imported torch.
"""

from __future__ import annotations

import logging

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(device: str) -> torch.device:
    """``"cpu"`` or ``"cuda"`` (this process sees only its own GPUs, so always ``cuda:0``)."""
    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r} requested but torch sees no CUDA device "
                           f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})")
    return torch.device("cuda:0")


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` is float32 on CPU and bfloat16 on GPU."""
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return DTYPES[dtype]


def load(model_path: str, device: torch.device, dtype: torch.dtype, max_memory: dict | None = None):
    """Load tokenizer and model in eval mode. Returns ``(model, tokenizer)``.

    With ``max_memory`` (several visible GPUs) the model is split layer-wise with
    ``device_map="auto"``: a pipeline of layers, not tensor parallelism.
    """
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if max_memory:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, device_map="auto", max_memory=max_memory)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
    model.eval()
    return model, tokenizer


def kv_shape(config) -> tuple[int, int, int]:
    """``(layers, kv_heads, head_dim)`` of a decoder config: kv_heads defaults to the attention
    heads (no GQA), head_dim to ``hidden_size // num_attention_heads``."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """KV-cache bytes one token costs: 2 (K and V) × layers × kv_heads × head_dim × element size.

    The formula is the standard one (vLLM's ``get_cache_block_size``, the article's §2).
    """
    layers, kv_heads, head_dim = kv_shape(config)
    return 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
