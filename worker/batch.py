"""A padded batch of sequences sharing one KV cache: the data structure of continuous batching.

This is TGI's early design for plain transformers models (``CausalLMBatch.concatenate`` and
``.filter`` in text-generation-inference's ``causal_lm.py``): the running sequences form one
left-padded batch whose KV cache is ``[B, kv_heads, L, head_dim]`` per layer. Newcomers are
prefilled as a batch of their own, then concatenated (the shorter cache is left-padded to the
longer); finished rows are dropped with an index select and all-padding columns are trimmed.
Positions come from the attention mask, so padding never shifts RoPE positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache


def _left_pad(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """Left-pad ``t`` with zeros along ``dim`` up to ``length``."""
    missing = length - t.shape[dim]
    if missing <= 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [missing, 0]
    return F.pad(t, pad)


class PaddedBatch:
    """KV cache and attention mask of B running sequences.

    ``mask``: [B, L] int64, 1 for real tokens, 0 for left padding. Each cache layer holds keys and
    values of shape [B, kv_heads, L, head_dim].
    """

    def __init__(self, cache: DynamicCache, mask: torch.Tensor):
        self.cache = cache
        self.mask = mask

    @property
    def size(self) -> int:
        return self.mask.shape[0]

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    @torch.inference_mode()
    def decode(self, model, input_ids: torch.Tensor) -> torch.Tensor:
        """One decode step. ``input_ids``: [B] last sampled tokens. Returns logits [B, V]."""
        positions = self.mask.sum(dim=1, keepdim=True)  # [B, 1]: count of real tokens so far
        self.mask = torch.cat([self.mask, self.mask.new_ones((self.size, 1))], dim=1)
        out = model(
            input_ids=input_ids[:, None], attention_mask=self.mask, position_ids=positions,
            cache=self.cache, use_cache=True, logits_to_keep=1,
        )
        return out.logits[:, -1, :]

    def filter(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` (in that order) and drop columns that are padding in all rows."""
        index = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        mask = self.mask.index_select(0, index)
        first = int((mask.sum(dim=0) > 0).nonzero()[0]) if mask.numel() else 0
        self.mask = mask[:, first:]
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, first:]
            layer.values = layer.values.index_select(0, index)[:, :, first:]

    def merge(self, other: "PaddedBatch") -> None:
        """Append the rows of ``other`` after this batch's rows (both caches left-padded to fit)."""
        length = max(self.length, other.length)
        self.mask = torch.cat([_left_pad(self.mask, length, 1), _left_pad(other.mask, length, 1)], dim=0)
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.keys = torch.cat([_left_pad(mine.keys, length, 2), _left_pad(theirs.keys, length, 2)], dim=0)
            mine.values = torch.cat([_left_pad(mine.values, length, 2), _left_pad(theirs.values, length, 2)], dim=0)


@torch.inference_mode()
def prefill(model, prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[PaddedBatch, torch.Tensor]:
    """Run the prompts through the model as one left-padded batch.

    Returns the new :class:`PaddedBatch` and the last-position logits [N, V].
    """
    length = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), length), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(prompts), length), dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        input_ids[row, length - len(prompt) :] = torch.tensor(prompt, dtype=torch.long, device=device)
        mask[row, length - len(prompt) :] = 1
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    out = model(
        input_ids=input_ids, attention_mask=mask, position_ids=positions,
        cache=cache, use_cache=True, logits_to_keep=1,
    )
    return PaddedBatch(cache, mask), out.logits[:, -1, :]
