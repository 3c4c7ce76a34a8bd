"""One request's state inside the worker: prompt, generated tokens, text stream, finish."""

from __future__ import annotations

import time

from worker.detok import IncrementalDetokenizer, StopMatcher
from worker.protocol import SamplingParams, Tokens, Usage
from worker.sampling import RowSampler


class Sequence:
    """A request being generated.

    ``worst_case_tokens`` (prompt + max_tokens, capped by ``max_model_len``) is what the scheduler
    reserves in the KV budget. ``append(token_id)`` records one sampled token and returns the
    :class:`Tokens` message to send (or ``None`` when there is no new text yet).
    """

    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams, tokenizer,
                 eos_ids: set[int], max_model_len: int, device):
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.output: list[int] = []
        self.max_new = max(1, min(params.max_tokens, max_model_len - len(prompt)))
        self.worst_case_tokens = len(prompt) + self.max_new
        self.eos_ids = set() if params.ignore_eos else eos_ids
        self.detok = IncrementalDetokenizer(tokenizer, prompt[-4:])
        self.stops = StopMatcher(params.stop)
        self.sampler = RowSampler(params.temperature, params.top_p, params.top_k, params.seed, device)
        self.finish_reason: str | None = None
        self.cancelled = False
        self.arrived = time.monotonic()
        self.first_token_at: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.cancelled

    def append(self, token_id: int) -> Tokens | None:
        """Record one sampled token; decide whether the sequence ends (eos, stop string, length)."""
        ttft = None
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
            ttft = self.first_token_at - self.arrived
        if token_id in self.eos_ids:
            self.finish_reason = "stop"
            delta = self.stops.flush()
        else:
            self.output.append(token_id)
            delta, stopped = self.stops.feed(self.detok.add(token_id))
            if stopped:
                self.finish_reason = "stop"
            elif len(self.output) >= self.max_new:
                self.finish_reason = "length"
                delta += self.stops.flush()
        if not delta and self.finish_reason is None and ttft is None:
            return None
        usage = None
        if self.finish_reason is not None:
            n = len(self.output)
            usage = Usage(prompt_tokens=len(self.prompt), completion_tokens=n, total_tokens=len(self.prompt) + n)
        return Tokens(request_id=self.request_id, text_delta=delta, token_ids=[token_id],
                      finish_reason=self.finish_reason, usage=usage, ttft_s=ttft)
