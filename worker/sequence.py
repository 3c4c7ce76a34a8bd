"""One request's state inside the worker: its tokens, how many have keys in the cache, its blocks,
its text stream and how it ends.

The engine never distinguishes "prefill" from "decode" by a flag: a sequence has ``num_tokens``
tokens (prompt, then output) of which the first ``computed`` have keys and values in the cache.
Each step computes some of the rest (a prefill chunk, or the one token sampled last step); when
``computed`` reaches ``num_tokens`` the step's logits give the next token. A preempted sequence
simply drops back to ``computed = 0`` and recomputes, its output kept.
"""

from __future__ import annotations

import time

from worker.blocks import BlockTable
from worker.contract.protocol import SamplingParams, TokenLogprob, Tokens, Usage
from worker.detok import IncrementalDetokenizer, StopMatcher
from worker.request import RequestStatus
from worker.sampling import RowSampler


class Sequence:
    """A request being generated.

    ``output`` may start non-empty: tokens an earlier attempt generated before its worker was lost
    (request migration). They are context like the prompt, are replayed through the detokenizer and
    stop matcher silently (their text was already delivered), count towards ``max_tokens`` and
    ``usage``, and the sampler continues at their position.
    """

    def __init__(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        tokenizer,
        eos_ids: set[int],
        max_model_len: int,
        device,
        vocab_size: int,
        output: list[int] | None = None,
        priority: int = 0,
        flex: bool = False,
    ):
        self.request_id = request_id
        self.priority = priority  # vLLM's: lower is scheduled first
        self.flex = flex  # service_tier "flex": may wait, may be preempted for an interactive request
        self.prompt = prompt
        self.params = params
        self.output: list[int] = list(output or [])
        self.max_output = max(1, min(params.max_tokens, max_model_len - len(prompt)))
        self.eos_ids = set() if params.ignore_eos else eos_ids
        self.detok = IncrementalDetokenizer(tokenizer, prompt[-4:])
        self.stops = StopMatcher(params.stop)
        for token in self.output:
            self.stops.feed(self.detok.add(token))
        self.sampler = RowSampler.from_params(
            params, device, vocab_size=vocab_size, prompt=prompt, output=self.output, eos_ids=eos_ids
        )  # raises SamplingError
        # Written by the scheduler only (worker.scheduler): status, place in the order, blocks, progress
        self.status = RequestStatus.WAITING
        self.arrival = 0
        self.queued_at = 0.0
        self.table = BlockTable()
        self.computed = 0  # leading tokens whose keys/values are in the cache
        self.cached_at_admission = 0
        self.preemptions = 0
        self.finish_reason: str | None = None  # what append() decided: "stop" or "length"
        self.arrived = time.monotonic()
        self.first_token_at: float | None = None
        # params.prompt_logprobs: tokens 1..P-1's, filled chunk by chunk by the runner, sent once
        self.prompt_logprobs: list[TokenLogprob] = []
        self.prompt_logprobs_sent = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt + self.output

    @property
    def max_tokens(self) -> int:
        """Prompt + the most output this sequence may reach: the KV tokens it can ever need."""
        return len(self.prompt) + self.max_output

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs and not all scored yet: every prompt position must be computed
        (the scheduler then takes no prefix-cache hit for it)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt) - 1

    def _take_prompt_logprobs(self) -> list[TokenLogprob] | None:
        if self.params.prompt_logprobs is None or self.prompt_logprobs_sent:
            return None
        self.prompt_logprobs_sent = True
        return self.prompt_logprobs

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids at positions ``[start, end)``."""
        n = len(self.prompt)
        if end <= n:
            return self.prompt[start:end]
        return (self.prompt[start:] if start < n else []) + self.output[max(0, start - n) : end - n]

    def append(self, token_id: int) -> Tokens:
        """Record one sampled token; decide whether the sequence ends (eos, stop string, length).
        Returns the message to send: every token id is reported, with or without new text, so the
        router knows every generated id (what a migrated request resumes from)."""
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
            elif len(self.output) >= self.max_output:
                self.finish_reason = "length"
                delta += self.stops.flush()
        usage = None
        if self.finish_reason is not None:
            n = len(self.output)
            usage = Usage(
                prompt_tokens=len(self.prompt),
                completion_tokens=n,
                total_tokens=len(self.prompt) + n,
                cached_tokens=min(self.cached_at_admission, len(self.prompt)),
            )
        return Tokens(
            request_id=self.request_id,
            text_delta=delta,
            token_ids=[token_id],
            finish_reason=self.finish_reason,
            usage=usage,
            ttft_s=ttft,
            logprobs=self.sampler.take_logprobs(),
            prompt_logprobs=self._take_prompt_logprobs(),
        )
