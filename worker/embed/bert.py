"""A BERT encoder's forward pass over packed tokens, its linears chosen by measurement.

transformers' ``BertModel`` runs a padded batch through ~20 modules a layer: three q/k/v matmuls,
a float mask built per call, dropout and view calls. Here the batch's tokens are packed into one
``[T, hidden]`` matrix (no pad rows in the matmuls), q/k/v are one fused weight, and each linear
runs the kernel :class:`worker.quant.linear.Linears` measured fastest on this machine for its shape
and row count (which kernel wins differs between CPUs, so it is measured, not assumed).
Only attention sees the batch padded: q/k/v are scattered to ``[batch, longest, ...]`` for
``scaled_dot_product_attention`` with a key-padding mask and gathered back.

The arithmetic is BERT's (Devlin et al. 2019; transformers' ``modeling_bert``): embeddings (word +
absolute position + token type 0) then LayerNorm; per layer, post-norm attention and feed-forward
blocks. Vectors match transformers' forward within float32 rounding (``tests/integration/test_embedder.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.quant.linear import Linears


def supports(model) -> bool:
    """Whether ``model`` (transformers' base model) is a BERT encoder this forward reproduces:
    ``model_type`` bert, absolute positions, not a decoder."""
    cfg = model.config
    return (
        cfg.model_type == "bert"
        and getattr(cfg, "position_embedding_type", "absolute") == "absolute"
        and not getattr(cfg, "is_decoder", False)
    )


@dataclass
class Layer:
    """One encoder layer: linears as callables ``x [T, K] -> [T, N]`` (no bias), biases and norms."""

    qkv: Callable
    qkv_bias: torch.Tensor
    out: Callable
    out_bias: torch.Tensor
    norm1: tuple[torch.Tensor, torch.Tensor]
    up: Callable
    up_bias: torch.Tensor
    down: Callable
    down_bias: torch.Tensor
    norm2: tuple[torch.Tensor, torch.Tensor]


class PackedBert:
    """``forward(ids [T], lens, longest)`` -> last hidden states [T, hidden] of the inputs packed in
    ``ids`` (input i is ``ids[sum(lens[:i]) : sum(lens[:i + 1])]``). Built from a loaded ``BertModel``,
    whose encoder weights then live in ``linears``' kernels (the model's own layers are dropped)."""

    def __init__(self, model, linears: Linears):
        from transformers.activations import ACT2FN

        cfg, emb = model.config, model.embeddings
        self.hidden, self.heads = cfg.hidden_size, cfg.num_attention_heads
        self.eps = cfg.layer_norm_eps
        self.act = ACT2FN[cfg.hidden_act]
        self.word = emb.word_embeddings.weight
        self.position = emb.position_embeddings.weight
        self.token_type = emb.token_type_embeddings.weight[0]  # one segment: sentence-transformers' input
        self.norm0 = (emb.LayerNorm.weight, emb.LayerNorm.bias)
        self.layers = [self._layer(block, linears) for block in model.encoder.layer]
        for t in (self.word, self.position, emb.token_type_embeddings.weight, *self.norm0):
            linears.count(t)
        model.encoder.layer = None  # its weights are held by the kernels (a prepacked layout may replace them)

    @staticmethod
    def _layer(block, linears: Linears) -> Layer:
        att, out = block.attention.self, block.attention.output
        qkv = torch.cat([att.query.weight, att.key.weight, att.value.weight]).detach().contiguous()
        qkv_bias = torch.cat([att.query.bias, att.key.bias, att.value.bias]).detach()
        norm1 = (out.LayerNorm.weight, out.LayerNorm.bias)
        norm2 = (block.output.LayerNorm.weight, block.output.LayerNorm.bias)
        biases = (qkv_bias, out.dense.bias, block.intermediate.dense.bias, block.output.dense.bias)
        for t in (*biases, *norm1, *norm2):
            linears.count(t)
        return Layer(
            qkv=linears(qkv),
            qkv_bias=qkv_bias,
            out=linears(out.dense.weight.detach()),
            out_bias=out.dense.bias,
            norm1=norm1,
            up=linears(block.intermediate.dense.weight.detach()),
            up_bias=block.intermediate.dense.bias,
            down=linears(block.output.dense.weight.detach()),
            down_bias=block.output.dense.bias,
            norm2=norm2,
        )

    def forward(self, ids: torch.Tensor, lens: torch.Tensor, longest: int) -> torch.Tensor:
        """Hidden states [T, hidden] of the packed inputs: ``ids`` [T] and ``lens`` [batch] (each
        input's length, ``longest`` the largest) int64 on the model's device."""
        starts = torch.cumsum(lens, 0) - lens
        positions = torch.arange(ids.shape[0], device=ids.device) - starts.repeat_interleave(lens)
        x = F.embedding(ids, self.word) + F.embedding(positions, self.position) + self.token_type
        x = F.layer_norm(x, (self.hidden,), *self.norm0, self.eps)
        attend = Attention(lens, longest, self.heads, self.hidden)
        for layer in self.layers:
            a = attend(layer.qkv(x).add_(layer.qkv_bias))
            x = F.layer_norm(layer.out(a).add_(layer.out_bias).add_(x), (self.hidden,), *layer.norm1, self.eps)
            h = self.act(layer.up(x).add_(layer.up_bias))
            x = F.layer_norm(layer.down(h).add_(layer.down_bias).add_(x), (self.hidden,), *layer.norm2, self.eps)
        return x


class Attention:
    """Bidirectional attention of one packed batch: ``qkv [T, 3 * hidden]`` -> ``[T, hidden]``, each
    input attending to its own tokens only. One input, or inputs of one length, need no mask; else
    the tokens are scattered to ``[batch, longest]`` rows and the pads masked out of every key."""

    def __init__(self, lens: torch.Tensor, longest: int, heads: int, hidden: int):
        self.batch, self.longest, self.heads, self.hidden = lens.shape[0], longest, heads, hidden
        self.ragged = bool((lens != longest).any())
        if self.ragged:
            real = torch.arange(longest, device=lens.device)[None, :] < lens[:, None]  # [batch, longest]
            self.rows = real.reshape(-1).nonzero().squeeze(1)  # packed token -> its padded row
            self.mask = real[:, None, None, :]  # broadcast over heads and queries: keys that are real

    def __call__(self, qkv: torch.Tensor) -> torch.Tensor:
        b, w, h = self.batch, self.longest, self.heads
        if self.ragged:
            padded = qkv.new_zeros(b * w, qkv.shape[1])
            padded[self.rows] = qkv
            qkv = padded
        q, k, v = qkv.view(b, w, 3, h, self.hidden // h).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask if self.ragged else None)
        out = out.transpose(1, 2).reshape(b * w, self.hidden)
        return out[self.rows] if self.ragged else out
