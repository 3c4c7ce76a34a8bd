"""An embedding model: transformers' ``AutoModel`` (the encoder or decoder stack, no head) and the
pooling its own files describe (:mod:`worker.contract.embed_spec`).

``embed`` runs one padded batch: inputs right-padded to the longest with an attention mask, the
last hidden states pooled over the real tokens (mean, cls, max, last token...), cut to the served
width and L2-normalised when the model says so. Right padding keeps a decoder's real tokens
unaffected by the pads (causal attention), so its last real token is read at ``length - 1``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

from worker.contract.embed_spec import EmbedSpec
from worker.embed.threads import ThreadPlan

log = logging.getLogger(__name__)

# architectures whose forward skips the pooler when it is None (transformers' add_pooling_layer=False)
POOLER_OPTIONAL = frozenset({"bert", "roberta", "xlm-roberta", "mpnet"})


class Embedder:
    """The loaded model on ``device`` in ``dtype`` and its :class:`EmbedSpec`; :meth:`embed` is the
    forward pass. ``vocab_size`` bounds valid token ids."""

    def __init__(self, model, spec: EmbedSpec, device: torch.device, pad_id: int):
        self.model = model
        self.spec = spec
        self.device = device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = int(model.config.vocab_size)
        self.pad_id = pad_id
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self._token_types = "token_type_ids" in model.forward.__code__.co_varnames
        self.threads = ThreadPlan() if device.type == "cpu" else None

    @classmethod
    def load(cls, model_path: str | Path, spec: EmbedSpec, device: torch.device, dtype: torch.dtype) -> Embedder:
        """Load ``model_path``'s weights (the base stack: ``AutoModel``) for inference; a folder served
        from a GGUF file (:mod:`worker.contract.gguf_link`) is dequantized by transformers."""
        from transformers import AutoModel

        from worker.contract.gguf_link import gguf_file

        gguf = gguf_file(model_path)
        extra = {"gguf_file": gguf.name} if gguf is not None else {}
        model = AutoModel.from_pretrained(str(model_path), dtype=dtype, **extra).to(device).eval()
        if model.config.model_type in POOLER_OPTIONAL:
            model.pooler = None  # the classification pooler (dense + tanh on [CLS]): its output is never read
        pad = model.config.pad_token_id
        return cls(model, spec, device, int(pad) if isinstance(pad, int) else 0)

    def idle(self) -> None:
        """The engine loop's keep-alive hook: one process, nothing to keep alive."""

    def probe(self, inputs: int, width: int, threads: int) -> None:
        """One forward pass of ``inputs`` x ``width`` tokens on ``threads`` torch threads, its
        vectors discarded (:func:`worker.embed.threads.measure` times it)."""
        torch.set_num_threads(threads)
        plan, self.threads = self.threads, None
        try:
            self.embed([[min(101, self.vocab_size - 1)] * width] * inputs)
        finally:
            self.threads = plan

    @torch.inference_mode()
    def embed(self, batch: list[list[int]]) -> np.ndarray:
        """Vectors of ``batch`` (token id lists, each non-empty): float32 array [len(batch), spec.dim]."""
        lengths = torch.tensor([len(ids) for ids in batch], device=self.device)
        width = int(lengths.max())
        padded, began = len(batch) * width, time.perf_counter()
        threads = self.threads.apply(padded) if self.threads is not None else 0
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        for row, tokens in enumerate(batch):
            ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        ids = ids.to(self.device)
        mask = (torch.arange(width, device=self.device)[None, :] < lengths[:, None]).long()
        kwargs = {"token_type_ids": torch.zeros_like(ids)} if self._token_types else {}
        hidden = self.model(input_ids=ids, attention_mask=mask, **kwargs).last_hidden_state.float()
        vectors = pool(hidden, mask, lengths, self.spec.pooling)[:, : self.spec.dim]
        if self.spec.normalize:
            vectors = torch.nn.functional.normalize(vectors, p=2, dim=1)
        out = vectors.cpu().numpy().astype("<f4", copy=False)
        if self.threads is not None:
            self.threads.record(padded, threads, time.perf_counter() - began)
        return out


def pool(hidden: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor, mode: str) -> torch.Tensor:
    """``hidden`` [batch, tokens, width] pooled over each row's real tokens (``mask`` 1) by ``mode``
    (sentence-transformers' names): [batch, width]."""
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    if mode == "cls":
        return hidden[:, 0]
    if mode == "lasttoken":
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1]
    if mode == "max":
        return hidden.masked_fill(weights == 0, float("-inf")).max(dim=1).values
    summed = (hidden * weights).sum(dim=1)
    counts = weights.sum(dim=1).clamp(min=1e-9)
    if mode == "mean_sqrt_len_tokens":
        return summed / counts.sqrt()
    return summed / counts  # mean
