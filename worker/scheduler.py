"""Which tokens of which sequences one engine step computes: chunked prefill, admission by need,
preemption. Pure logic over :class:`~worker.sequence.Sequence`-like objects and a
:class:`~worker.blocks.BlockManager`; no torch, so it is unit-tested directly.

Policy (vLLM's v1 scheduler and nano-vllm's, first come first served):

* Every running sequence with one token left to compute (the token sampled last step) decodes it
  this step. Its block table grows by one block when that token starts a new block; when no block
  is free, the newest running sequence is preempted — its blocks freed, it goes back to the head
  of the queue and is recomputed later (cheaply, from whatever of its blocks the prefix cache
  still holds) — until the growth fits. Nothing fails for lack of memory mid-decode.
* Prompt tokens are computed in chunks under a per-step budget of ``max_prefill_tokens``: a long
  document is prefilled over several steps while the others keep decoding, and several short
  newcomers share one step's budget. A step with nothing to decode uses ``idle_prefill_tokens``.
* A waiting request is admitted when the blocks for its tokens (less its prefix-cache hits) are
  free with one block to spare per running sequence (so the running ones can grow), and fewer than
  ``max_num_seqs`` run. It reserves what it needs now, not the padded worst case of the batch: a
  long document does not cap how many short chats run beside it. The head of the queue is never
  overtaken. A sequence that must score its prompt (prompt logprobs, :mod:`worker.prompt_logprobs`)
  takes no prefix-cache hit: every position is computed (its blocks still serve later requests).
* The worker holds at most ``max_num_seqs + max_waiting`` requests (:class:`QueueFull` beyond it,
  which the router's count mirrors), a request that could never fit the whole cache alone is
  refused at once (:class:`TooLarge`), and one that waited longer than ``max_queue_wait_s`` is
  dropped from the queue (the engine answers 503 with Retry-After).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from worker.blocks import BlockManager


class QueueFull(Exception):
    """The worker already holds ``max_num_seqs + max_waiting`` requests."""


class TooLarge(Exception):
    """The request alone needs more KV tokens than the whole cache holds."""


@dataclass
class Plan:
    """One step's work. ``decode``: sequences computing their one last token; ``prefill``:
    ``(sequence, start, end)`` chunks of positions ``[start, end)``; ``preempted`` and ``expired``
    left the running set or the queue during planning."""

    decode: list = field(default_factory=list)
    prefill: list = field(default_factory=list)
    preempted: list = field(default_factory=list)
    expired: list = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler:
    """FCFS admission by need under a block budget, chunked prefill under a token budget, preemption."""

    def __init__(
        self,
        blocks: BlockManager,
        max_num_seqs: int,
        max_waiting: int,
        max_prefill_tokens: int,
        idle_prefill_tokens: int | None = None,
        max_queue_wait_s: float = float("inf"),
        clock=time.monotonic,
    ):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_waiting = max_waiting
        self.max_prefill_tokens = max_prefill_tokens
        self.idle_prefill_tokens = max(max_prefill_tokens, idle_prefill_tokens or max_prefill_tokens)
        self.max_queue_wait_s = max_queue_wait_s
        self.clock = clock
        self.waiting: deque = deque()
        self.running: list = []
        self.peak_running = 0
        self.preemptions = 0

    @property
    def capacity_tokens(self) -> int:
        return self.blocks.num_blocks * self.blocks.block_size

    @property
    def reserved_tokens(self) -> int:
        """KV tokens held by running sequences (allocated block slots)."""
        return sum(len(s.table.blocks) for s in self.running) * self.blocks.block_size

    def add(self, seq) -> None:
        """Queue a request. Raises :class:`TooLarge` or :class:`QueueFull`."""
        if seq.max_tokens > self.capacity_tokens:
            raise TooLarge(
                f"request needs {seq.max_tokens} KV tokens (prompt {len(seq.prompt)} + max_tokens "
                f"{seq.max_output}) but this worker's KV cache holds {self.capacity_tokens} tokens"
            )
        if len(self.waiting) + len(self.running) >= self.max_num_seqs + self.max_waiting:
            raise QueueFull(f"worker is full: {len(self.running)} running, {len(self.waiting)} waiting")
        seq.queued_at = self.clock()
        self.waiting.append(seq)

    def schedule(self) -> Plan:
        """Plan one step (see the module docstring). Mutates ``running``, ``waiting`` and block tables."""
        plan = Plan()
        self._expire(plan)
        self._plan_decodes(plan)
        budget = self.max_prefill_tokens if plan.decode else self.idle_prefill_tokens
        for seq in self.running:
            left = seq.num_tokens - seq.computed
            if left > 1 and budget > 0:
                n = min(left, budget)
                plan.prefill.append((seq, seq.computed, seq.computed + n))
                budget -= n
        self._admit(plan, budget)
        self.peak_running = max(self.peak_running, len(self.running))
        return plan

    def _plan_decodes(self, plan: Plan) -> None:
        """Every running sequence with one token to compute decodes it; one whose next block does
        not fit preempts the newest (itself, last)."""
        for seq in list(self.running):
            if seq not in self.running or seq.num_tokens - seq.computed != 1:
                continue
            while not self.blocks.grow(seq.table, seq.num_tokens):
                victim = self.running[-1]
                self.preempt(victim, plan)
                if victim is seq:
                    break
            else:
                plan.decode.append(seq)

    def _admit(self, plan: Plan, budget: int) -> None:
        """Admit waiting sequences in order while the prefill ``budget``, the batch and the KV cache
        allow; each starts its prefill (or decodes, when its prompt was all cached)."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # A sequence scoring its prompt (prompt logprobs) computes every position: no cache hits
            use_cache = not getattr(seq, "needs_prompt_logprobs", False)
            if not self.blocks.can_allocate(seq.token_ids, reserve=len(self.running), use_cache=use_cache):
                break
            self.waiting.popleft()
            seq.table, seq.computed = self.blocks.allocate(seq.token_ids, use_cache=use_cache)
            if not seq.preemptions:  # a re-admission finds its own blocks: not a hit of the prompt
                seq.cached_at_admission = seq.computed
            self.running.append(seq)
            left = seq.num_tokens - seq.computed
            if left == 1:
                plan.decode.append(seq)
                budget -= 1
            else:
                n = min(left, budget)
                plan.prefill.append((seq, seq.computed, seq.computed + n))
                budget -= n

    def finish_step(self, plan: Plan) -> list:
        """After the step's forward pass: advance ``computed``, register newly full blocks in the
        prefix cache. Returns the sequences whose next token is to be sampled now."""
        ready = []
        for seq in plan.decode:
            seq.computed += 1
            ready.append(seq)
        for seq, _, end in plan.prefill:
            seq.computed = end
            if end == seq.num_tokens:
                ready.append(seq)
        for seq in [*plan.decode, *(s for s, _, _ in plan.prefill)]:  # each scheduled sequence once
            if seq.computed // self.blocks.block_size > len(seq.table.hashes):  # it filled a block this step
                self.blocks.register(seq.table, seq.token_ids, seq.computed)
        return ready

    def retire(self, done: set[str]) -> list:
        """Remove running sequences whose ids are in ``done`` and free their blocks; return them."""
        gone = [s for s in self.running if s.request_id in done]
        self.running = [s for s in self.running if s.request_id not in done]
        for seq in gone:
            self.blocks.release(seq.table)
        return gone

    def drop_waiting(self, request_id: str):
        """Remove a request that is not running (cancelled); return it if it was waiting."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                return seq
        return None

    def preempt(self, seq, plan: Plan | None = None) -> None:
        """Free a running sequence's blocks and put it back at the head of the queue (recomputed later)."""
        plan = plan if plan is not None else Plan()
        self.running.remove(seq)
        self.blocks.release(seq.table)
        seq.computed = 0
        seq.preemptions += 1
        self.preemptions += 1
        for i, (s, _, _) in enumerate(plan.prefill):
            if s is seq:
                del plan.prefill[i]
                break
        if seq in plan.decode:
            plan.decode.remove(seq)
        seq.queued_at = self.clock()
        self.waiting.appendleft(seq)
        plan.preempted.append(seq)

    def _expire(self, plan: Plan) -> None:
        now = self.clock()
        late = [s for s in self.waiting if now - s.queued_at > self.max_queue_wait_s]
        if late:
            plan.expired += late
            self.waiting = deque(s for s in self.waiting if s not in late)
