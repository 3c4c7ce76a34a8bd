"""Admission control for continuous batching: who runs, who waits.

Pure logic over objects with ``worst_case_tokens`` and ``prompt``; no torch, so it is unit-tested
directly. Policy, first come first served (vLLM's and TGI's default):

* at most ``max_num_seqs`` sequences run at once;
* the KV cache is a left-padded batch, so its worst-case size is
  ``rows × max(worst_case_tokens of the rows)``; a newcomer is admitted only while that product,
  newcomer included, fits ``kv_budget_tokens``;
* at most ``max_prefill_tokens`` prompt tokens, and at most ``max_prefill_seqs`` requests, are
  prefilled in one step (at least one request), which bounds the pause a prefill puts between the
  running sequences' tokens (ITL). On CPU the worker prefills one request per step: prefill is
  compute-bound there, so batching newcomers gains nothing and makes all but the first wait for
  the others' prompts; worse, requests prefilled together finish together, and in a closed loop
  their successors arrive together again, so the whole batch keeps arriving in waves;
* the worker holds at most ``max_num_seqs + max_waiting`` requests, running and waiting together:
  the capacity the router counts per worker before it answers 429 itself. So the waiting queue
  is bounded (``max_waiting``, plus whatever batch slots the KV budget leaves empty) and the
  worker never refuses a request the router let through; ``add`` raises :class:`QueueFull` beyond it.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol


class Schedulable(Protocol):
    request_id: str
    prompt: list[int]
    worst_case_tokens: int


class QueueFull(Exception):
    """The worker already holds ``max_num_seqs + max_waiting`` requests."""


class TooLarge(Exception):
    """The request alone exceeds the KV budget and could never be admitted."""


class Scheduler:
    """FCFS admission under a sequence cap and a padded-batch KV budget (in tokens)."""

    def __init__(self, max_num_seqs: int, max_waiting: int, kv_budget_tokens: int, max_prefill_tokens: int = 4096,
                 max_prefill_seqs: int | None = None):
        self.max_num_seqs = max_num_seqs
        self.max_waiting = max_waiting
        self.kv_budget_tokens = kv_budget_tokens
        self.max_prefill_tokens = max_prefill_tokens
        self.max_prefill_seqs = max_prefill_seqs or max_num_seqs
        self.waiting: deque[Schedulable] = deque()
        self.running: list[Schedulable] = []
        self.peak_running = 0

    @staticmethod
    def padded_tokens(seqs: list[Schedulable]) -> int:
        """Worst-case KV tokens of a left-padded batch of ``seqs``: rows × longest worst case."""
        return len(seqs) * max((s.worst_case_tokens for s in seqs), default=0)

    @property
    def reserved_tokens(self) -> int:
        return self.padded_tokens(self.running)

    def add(self, seq: Schedulable) -> None:
        """Queue a request. Raises :class:`TooLarge` or :class:`QueueFull`."""
        if seq.worst_case_tokens > self.kv_budget_tokens:
            raise TooLarge(f"request needs {seq.worst_case_tokens} KV tokens, budget is {self.kv_budget_tokens}")
        if len(self.waiting) + len(self.running) >= self.max_num_seqs + self.max_waiting:
            raise QueueFull(f"worker is full: {len(self.running)} running, {len(self.waiting)} waiting")
        self.waiting.append(seq)

    def admit(self) -> list[Schedulable]:
        """Move the waiting requests that fit, in arrival order, to ``running``; return them."""
        admitted: list[Schedulable] = []
        prefill = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            head = self.waiting[0]
            if self.padded_tokens(self.running + [head]) > self.kv_budget_tokens:
                break  # FCFS: nobody overtakes the head of the queue
            if admitted and (prefill + len(head.prompt) > self.max_prefill_tokens
                             or len(admitted) >= self.max_prefill_seqs):
                break
            self.waiting.popleft()
            self.running.append(head)
            admitted.append(head)
            prefill += len(head.prompt)
        self.peak_running = max(self.peak_running, len(self.running))
        return admitted

    def retire(self, done: set[str]) -> list[int]:
        """Drop running requests whose ids are in ``done``; return the kept rows' old indices."""
        keep = [i for i, s in enumerate(self.running) if s.request_id not in done]
        self.running = [self.running[i] for i in keep]
        return keep

    def drop_waiting(self, request_id: str) -> Schedulable | None:
        """Remove a request that has not started yet (cancelled); return it if it was waiting."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                return seq
        return None
