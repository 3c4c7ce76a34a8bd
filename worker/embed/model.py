"""An embedding model: transformers' ``AutoModel`` (the encoder or decoder stack, no head) and the
pooling its own files describe (:mod:`worker.contract.embed_spec`).

``embed`` runs one batch and pools each input's last hidden states over its real tokens (mean, cls,
max, last token...), cuts them to the served width and L2-normalises them when the model says so.
A BERT encoder runs packed (:mod:`worker.embed.bert`: no pad rows, kernels measured at load);
any other model runs transformers' forward on the inputs right-padded to the longest with an
attention mask (right padding keeps a decoder's real tokens unaffected by the pads, so its last
real token is read at ``length - 1``).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

from worker.contract.embed_spec import EmbedSpec
from worker.embed import bert
from worker.embed.threads import ThreadPlan
from worker.quant.linear import Linears

log = logging.getLogger(__name__)

# architectures whose forward skips the pooler when it is None (transformers' add_pooling_layer=False)
POOLER_OPTIONAL = frozenset({"bert", "roberta", "xlm-roberta", "mpnet"})
TUNED_ROWS = 128  # the packed encoder's linears are measured up to this many rows (larger: compute-bound)


class Embedder:
    """The loaded model on ``device`` in ``dtype`` and its :class:`EmbedSpec`; :meth:`embed` is the
    forward pass. ``vocab_size`` bounds valid token ids. ``packed``: the BERT encoder's own forward
    (:class:`~worker.embed.bert.PackedBert`) when the model is one, with its kernel table in
    ``linears``; else None and transformers' forward runs."""

    def __init__(self, model, spec: EmbedSpec, device: torch.device, pad_id: int, packed: bool = True):
        self.model = model
        self.spec = spec
        self.device = device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = int(model.config.vocab_size)
        self.pad_id = pad_id
        self._token_types = "token_type_ids" in model.forward.__code__.co_varnames
        self.threads = ThreadPlan() if device.type == "cpu" else None
        self.linears: Linears | None = None
        self.packed: bert.PackedBert | None = None
        if packed and bert.supports(model):
            self._pack(model)
        self.weight_bytes = (
            self.linears.weight_bytes
            if self.linears is not None
            else sum(p.numel() * p.element_size() for p in model.parameters())
        )

    def _pack(self, model) -> None:
        """Build the packed encoder. On CPU its kernels are measured on one thread by that thread's
        CPU clock: on a busy CPU a wall-clock timing on several threads measures OpenMP barriers
        waiting for a descheduled thread (orders of magnitude longer than the product), not the
        kernel; the thread plan (:mod:`worker.embed.threads`) then picks the threads per batch."""
        cpu = self.device.type == "cpu"
        before = torch.get_num_threads()
        if cpu:
            torch.set_num_threads(1)
        try:
            self.linears = Linears(
                self.device, self.dtype, max_rows=TUNED_ROWS, timer=time.thread_time if cpu else time.perf_counter
            )
            with torch.inference_mode():
                self.packed = bert.PackedBert(model, self.linears)
        finally:
            torch.set_num_threads(before)
        self.linears.log_table()

    @classmethod
    def load(
        cls, model_path: str | Path, spec: EmbedSpec, device: torch.device, dtype: torch.dtype, packed: bool = True
    ) -> Embedder:
        """Load ``model_path``'s weights (the base stack: ``AutoModel``) for inference; a folder served
        from a GGUF file (:mod:`worker.contract.gguf_link`) is dequantized by transformers.
        ``packed=False`` keeps transformers' forward for a BERT encoder too (tests compare the two)."""
        from transformers import AutoModel

        from worker.contract.gguf_link import gguf_file

        gguf = gguf_file(model_path)
        extra = {"gguf_file": gguf.name} if gguf is not None else {}
        model = AutoModel.from_pretrained(str(model_path), dtype=dtype, **extra).to(device).eval()
        if model.config.model_type in POOLER_OPTIONAL:
            model.pooler = None  # the classification pooler (dense + tanh on [CLS]): its output is never read
        pad = model.config.pad_token_id
        return cls(model, spec, device, int(pad) if isinstance(pad, int) else 0, packed)

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
        padded, began = len(batch) * max(len(ids) for ids in batch), time.perf_counter()
        threads = self.threads.apply(padded) if self.threads is not None else 0
        pooled = self._packed(batch) if self.packed is not None else self._padded(batch)
        vectors = pooled[:, : self.spec.dim]
        if self.spec.normalize:
            vectors = torch.nn.functional.normalize(vectors, p=2, dim=1)
        out = vectors.cpu().numpy().astype("<f4", copy=False)
        if self.threads is not None:
            self.threads.record(padded, threads, time.perf_counter() - began)
        return out

    def _packed(self, batch: list[list[int]]) -> torch.Tensor:
        """Pooled [batch, hidden] float32 from the packed encoder."""
        lengths = [len(ids) for ids in batch]
        ids = torch.tensor([t for tokens in batch for t in tokens], dtype=torch.long, device=self.device)
        lens = torch.tensor(lengths, device=self.device)
        hidden = self.packed.forward(ids, lens, max(lengths)).float()
        return pool_packed(hidden, lens, self.spec.pooling)

    def _padded(self, batch: list[list[int]]) -> torch.Tensor:
        """Pooled [batch, hidden] float32 from transformers' forward on the right-padded batch."""
        lengths = torch.tensor([len(ids) for ids in batch], device=self.device)
        width = int(lengths.max())
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        for row, tokens in enumerate(batch):
            ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        ids = ids.to(self.device)
        mask = (torch.arange(width, device=self.device)[None, :] < lengths[:, None]).long()
        kwargs = {"token_type_ids": torch.zeros_like(ids)} if self._token_types else {}
        hidden = self.model(input_ids=ids, attention_mask=mask, **kwargs).last_hidden_state.float()
        return pool(hidden, mask, lengths, self.spec.pooling)


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


def pool_packed(hidden: torch.Tensor, lengths: torch.Tensor, mode: str) -> torch.Tensor:
    """``hidden`` [T, width] of inputs packed back to back (input i has ``lengths[i]`` rows) pooled
    per input by ``mode`` as :func:`pool` does: [batch, width]."""
    ends = torch.cumsum(lengths, 0)
    if mode == "cls":
        return hidden[ends - lengths]
    if mode == "lasttoken":
        return hidden[ends - 1]
    if mode == "max":
        return torch.segment_reduce(hidden, "max", lengths=lengths, axis=0)
    segment = torch.repeat_interleave(torch.arange(lengths.shape[0], device=hidden.device), lengths)
    summed = hidden.new_zeros(lengths.shape[0], hidden.shape[1]).index_add_(0, segment, hidden)
    counts = lengths.to(hidden.dtype).unsqueeze(1)
    if mode == "mean_sqrt_len_tokens":
        return summed / counts.sqrt()
    return summed / counts  # mean
