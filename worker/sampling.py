"""Per-sequence sampling over one batch of logits.

Each row of the batch has its own parameters; a row with a ``seed`` draws from its own
``torch.Generator``, so its output does not depend on what else shares the batch.
Top-p (nucleus) follows Holtzman et al. 2019 as implemented in transformers' ``TopPLogitsWarper``.
"""

from __future__ import annotations

import torch

# Below this a temperature means greedy, as in vLLM (_SAMPLING_EPS): dividing logits by 1e-300
# overflows to inf and breaks the softmax.
GREEDY_BELOW = 1e-5


class RowSampler:
    """Sampling state of one sequence: temperature, top-p, top-k and an optional seeded RNG."""

    def __init__(self, temperature: float, top_p: float, top_k: int, seed: int | None, device: torch.device):
        self.temperature = 0.0 if temperature < GREEDY_BELOW else temperature
        self.top_p = top_p
        self.top_k = top_k
        self.generator: torch.Generator | None = None
        if seed is not None and self.temperature > 0:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(seed)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def sample(self, logits: torch.Tensor) -> int:
        """Pick one token from ``logits`` [V] (float). Returns the token id."""
        if self.greedy:
            return int(torch.argmax(logits))
        logits = logits.float() / self.temperature
        if self.top_k > 0:
            kth = torch.topk(logits, min(self.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if self.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            drop = cumulative - sorted_probs > self.top_p  # keep the smallest set reaching top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def sample_batch(logits: torch.Tensor, samplers: list[RowSampler]) -> list[int]:
    """Sample one token per row. ``logits``: [B, V]; returns B token ids.

    Greedy rows share one vectorized argmax; other rows are sampled one by one.
    """
    greedy_ids = torch.argmax(logits, dim=-1).tolist()
    return [g if s.greedy else s.sample(logits[i]) for i, (g, s) in enumerate(zip(greedy_ids, samplers))]
