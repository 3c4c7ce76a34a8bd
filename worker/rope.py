"""RoPE's cos and sin tables for a Llama-family model, computed as transformers' ``LlamaRotaryEmbedding``
computes them: its RoPE init functions (``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS``:
Llama 3 scaling, linear, dynamic NTK, YaRN, LongRoPE; the default is ``LlamaRotaryEmbedding``'s own
formula) and its ``dynamic_rope_update`` (dynamic NTK and LongRoPE at the table's length).

Why not ``LlamaRotaryEmbedding`` itself: it lives in ``transformers.models.llama.modeling_llama``,
whose import brings transformers' model utilities and ``torch._dynamo`` into a worker that uses
none of them (CPU time at every worker start; tests/README.md has the measurement);
``modeling_rope_utils`` is already loaded with the model's config. ``tests/unit/test_rope.py`` checks the tables against
``LlamaRotaryEmbedding`` for every RoPE type, so a transformers release that computes one
differently fails there."""

from __future__ import annotations

import functools

import torch


def _default_parameters(config, *_args, **_kwargs) -> tuple[torch.Tensor, float]:
    """``LlamaRotaryEmbedding.compute_default_rope_parameters``: the original RoPE's inverse
    frequencies ``[head_dim / 2]`` and an attention scaling of 1."""
    base = config.rope_parameters["rope_theta"]
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0


@functools.cache
def _rotary_class() -> type:
    """The rotary module, made on first use (transformers' RoPE helpers imported then)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update

    class Rotary(torch.nn.Module):
        """``LlamaRotaryEmbedding``'s state and forward (the attributes ``dynamic_rope_update`` reads)."""

        def __init__(self, config):
            super().__init__()
            self.max_seq_len_cached = self.original_max_seq_len = config.max_position_embeddings
            self.config = config
            self.rope_type = config.rope_parameters["rope_type"]
            init = _default_parameters if self.rope_type == "default" else ROPE_INIT_FUNCTIONS[self.rope_type]
            inv_freq, self.attention_scaling = init(config)
            self.register_buffer("inv_freq", inv_freq, persistent=False)
            self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

        @dynamic_rope_update
        def forward(self, x, position_ids):
            freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
            emb = torch.cat((freqs, freqs), dim=-1)
            return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)

    return Rotary


def rope_tables(config, positions: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[positions, head_dim]`` (float32) for positions ``0 … positions - 1`` of ``config``'s
    RoPE (``config.rope_parameters``), on ``device``. Raises ``KeyError`` for a RoPE type transformers
    does not know."""
    rope = _rotary_class()(config).to(device)
    pos = torch.arange(positions, device=device)[None, :]
    cos, sin = rope(torch.empty(0, dtype=torch.float32, device=device), pos)
    return cos[0].float(), sin[0].float()
