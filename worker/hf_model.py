"""Any transformers decoder over the engine's block KV cache, through transformers' attention interface.

The fallback for architectures :mod:`worker.llama` does not cover, and for replicas split by layers
over several GPUs (``workers.gpus_per_replica``, transformers' ``device_map``). The model runs its
own modules — embeddings, RoPE, norms, MLPs — on the step's flattened tokens as one sequence
(``[1, T]`` with each token's own position id), and every attention layer calls
:func:`paged_attention` (registered as ``attn_implementation="llamadeploy_paged"``), which writes
the keys and values into the block cache and attends with :func:`worker.attention.attend`: the same
chunked prefill, prefix caching and preemption as the compact path, at transformers' per-operation
cost.
"""

from __future__ import annotations

import threading

import torch
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.masking_utils import AttentionMaskInterface

from worker.attention import AttentionBatch, KVCache, attend
from worker.contract.shapes import attention_dims

IMPLEMENTATION = "llamadeploy_paged"
_step = threading.local()  # the step being run: its AttentionBatch and KVCache (one engine thread)


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function contract: ``query`` [1, H, T, D], ``key``/``value``
    [1, KVH, T, D] (RoPE applied) -> ``(output [1, T, H, D], None)``."""
    _, H, T, D = query.shape
    out = attend(
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        _step.cache,
        module.layer_idx,
        _step.batch,
        scaling if scaling is not None else D**-0.5,
    )
    return out.view(1, T, H, D), None


def _no_mask(*args, **kwargs):
    return None  # paged_attention builds its own masks from the AttentionBatch


AttentionInterface.register(IMPLEMENTATION, paged_attention)
AttentionMaskInterface.register(IMPLEMENTATION, _no_mask)


class HFModel:
    """A transformers causal LM with :class:`worker.llama.LlamaModel`'s ``forward`` signature."""

    def __init__(self, model):
        self.model = model
        c = model.config
        self.config = c
        self.heads, self.kv_heads, self.head_dim = attention_dims(c)
        self.dtype = model.dtype
        self.num_layers = c.num_hidden_layers

    @classmethod
    def load(cls, model_path: str, dtype: torch.dtype, device: torch.device, max_memory: dict | None = None) -> HFModel:
        """Load straight to ``device`` (``device_map``), or split by layers over ``max_memory``'s GPUs."""
        device_map = "auto" if max_memory else {"": str(device)}
        model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=dtype, device_map=device_map, max_memory=max_memory, attn_implementation=IMPLEMENTATION
        )
        return cls(model.eval())

    def layer_devices(self) -> list[torch.device]:
        """The device of each decoder layer (where its slice of the KV cache must live)."""
        return [next(layer.parameters()).device for layer in self.model.model.layers]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        cache: KVCache,
        logit_rows: torch.Tensor,
    ) -> torch.Tensor:
        _step.batch, _step.cache = batch, cache
        try:
            hidden = self.model.model(
                input_ids=input_ids[None], position_ids=positions[None], use_cache=False
            ).last_hidden_state[0]  # [T, hidden]
        finally:
            _step.batch = _step.cache = None
        head = self.model.lm_head
        rows = hidden[logit_rows.to(hidden.device)]
        return head(rows.to(head.weight.device)).float()  # [N, V]
