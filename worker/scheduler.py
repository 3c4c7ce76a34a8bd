"""Which tokens of which sequences one engine step computes, and every change of a request's state:
admission, chunked prefill, preemption, backing off after an out-of-memory, finishing. Pure logic
over :class:`~worker.sequence.Sequence`-like objects and a :class:`~worker.blocks.BlockManager`; no
torch, so it is unit-tested directly. It is the only writer of a request's ``status``
(:class:`~worker.request.RequestStatus`), ``computed`` and block table.

Policy (vLLM's v1 scheduler with its partial-prefill limits and ``--scheduling-policy priority``,
nano-vllm's block accounting):

* **Order.** Waiting requests are ordered by (flex, ``priority``, arrival): an interactive request
  before a ``service_tier: flex`` one, then vLLM's integer priority (lower first), then first come
  first served. A preempted request keeps its place (its arrival).
* **Decodes first.** Every running sequence with one token left to compute (the token sampled last
  step) decodes it this step. Its block table grows by one block when that token starts a new
  block; when no block is free, a running sequence is preempted — its blocks freed, it goes back to
  the queue and is recomputed later (cheaply, from whatever of its blocks the prefix cache still
  holds) — until the growth fits: a flex one first, then the highest ``priority`` value, then the
  newest admitted. Nothing fails for lack of memory mid-decode.
* **Short prompts next.** Prompt tokens are computed in chunks under a per-step budget of
  ``max_prefill_tokens`` (``idle_prefill_tokens`` when nothing decodes). With measured step costs
  (``cost``, :mod:`worker.step_cost`: a CPU's ``max_prefill_tokens: auto``) a step that decodes
  has a budget in token equivalents instead, what keeps it within a bound of a decode step of its
  rows, and a chunk spends its tokens plus its attention over the keys before it: a prompt's later
  chunks are shorter, and every such step takes about as long. A prompt is *short* when
  it has at most ``long_prefill_token_threshold`` tokens to compute: a waiting one its whole
  length, a running one what was left to compute when it was admitted (after its prefix-cache
  hits). A long prompt stays long to its last chunk, so its tail never takes the short prompts'
  part of the budget. Short prompts already prefilling continue, then waiting short ones are
  admitted in order — including those queued behind a long prompt, which does not block them (no
  head-of-line blocking) unless it could start now and only KV memory stops it.
* **Long prompts share what is left**, and at least ``long_prefill_share`` of the step's budget
  whenever one is prefilling or could start: at most ``max_long_partial_prefills`` long prompts
  prefill at once (the others wait their turn in order), so every long prefill advances by at
  least ``ceil(share * budget / max_long_partial_prefills)`` tokens each step and none starves
  however many short prompts arrive.
* **Admission by need.** A waiting request is admitted when the blocks for its tokens (less its
  prefix-cache hits) are free with one block to spare per running sequence (so the running ones can
  grow), and fewer than ``max_num_seqs`` run. It reserves what it needs now, not the padded worst
  case of the batch. An interactive request that does not fit, in the cache or in the batch
  (``max_num_seqs`` running), preempts running flex sequences, newest first, until it fits
  (recompute preemption: the flex one resumes later, its text unchanged, recomputing only what the
  prefix cache no longer holds). A sequence that must score its prompt (prompt logprobs,
  :mod:`worker.prompt_logprobs`) takes no prefix-cache hit: every position is computed (its blocks
  still serve later requests).
* The worker holds at most ``max_num_seqs + max_waiting`` requests (:class:`QueueFull` beyond it,
  which the router's count mirrors), a request that could never fit the whole cache alone is
  refused at once (:class:`TooLarge`), and one that waited longer than ``max_queue_wait_s`` is
  dropped from the queue (the engine answers 503 with Retry-After).
"""

from __future__ import annotations

import bisect
import itertools
import math
import time
from dataclasses import dataclass, field

from worker.blocks import BlockManager
from worker.contract.settings import LONG_PREFILL_SHARE, LONG_PREFILL_TOKEN_THRESHOLD, MAX_LONG_PARTIAL_PREFILLS
from worker.request import RequestStatus
from worker.step_cost import StepCost


class QueueFull(Exception):
    """The worker already holds ``max_num_seqs + max_waiting`` requests."""


class TooLarge(Exception):
    """The request alone needs more KV tokens than the whole cache holds."""


@dataclass
class StepPlan:
    """One engine step's work, as :meth:`Scheduler.schedule` decided it (vLLM's ``SchedulerOutput``).
    ``decode``: sequences computing their one last token; ``prefill``: ``(sequence, start, end)``
    chunks of positions ``[start, end)``; ``preempted`` and ``expired`` left the running set or the
    queue during planning."""

    decode: list = field(default_factory=list)
    prefill: list = field(default_factory=list)
    preempted: list = field(default_factory=list)
    expired: list = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


@dataclass(frozen=True)
class PrefillShares:
    """How a step's prefill budget is shared between short and long prompts (vLLM's
    ``long_prefill_token_threshold`` and ``max_long_partial_prefills``; ``long_share``: the least
    fraction of the budget kept for long prompts while one prefills or could start)."""

    long_threshold: int = LONG_PREFILL_TOKEN_THRESHOLD
    max_long: int = MAX_LONG_PARTIAL_PREFILLS
    long_share: float = LONG_PREFILL_SHARE


@dataclass
class OomBackOff:
    """What :meth:`Scheduler.back_off_after_oom` did: the prefill budget it halved to, the sequence
    it preempted, or the lone sequences it aborted (the engine fails those)."""

    prefill_tokens: int | None = None
    preempted: object | None = None
    aborted: list = field(default_factory=list)


class Scheduler:
    """Admission by need under a block budget in (flex, priority, arrival) order, short prompts
    before long ones in each step's prefill budget, preemption (see the module docstring)."""

    def __init__(
        self,
        blocks: BlockManager,
        max_num_seqs: int,
        max_waiting: int,
        max_prefill_tokens: int,
        idle_prefill_tokens: int | None = None,
        max_queue_wait_s: float = float("inf"),
        clock=time.monotonic,
        shares: PrefillShares | None = None,
        cost: StepCost | None = None,
    ):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_waiting = max_waiting
        self.max_prefill_tokens = max_prefill_tokens
        self.idle_prefill_tokens = max(max_prefill_tokens, idle_prefill_tokens or max_prefill_tokens)
        self.max_queue_wait_s = max_queue_wait_s
        self.clock = clock
        self.shares = shares or PrefillShares()
        self.cost = cost  # sizes the chunks of steps that decode too (None: max_prefill_tokens tokens)
        self._beside = 0  # decode rows of the step being planned (0: nothing decodes)
        self.waiting: list = []  # sorted by _rank
        self.running: list = []  # in admission order
        self._long: set[str] = set()  # request ids of the running sequences admitted as long prompts
        self.peak_running = 0
        self.preemptions = 0
        self._arrivals = itertools.count()

    @property
    def capacity_tokens(self) -> int:
        return self.blocks.num_blocks * self.blocks.block_size

    @property
    def reserved_tokens(self) -> int:
        """KV tokens held by running sequences (allocated block slots)."""
        return sum(len(s.table.blocks) for s in self.running) * self.blocks.block_size

    def set_prefill_budget(
        self, max_prefill_tokens: int, idle_prefill_tokens: int, cost: StepCost | None = None
    ) -> None:
        """Prompt tokens per step beside decodes and with nothing decoding (the replica's calibration);
        with ``cost`` a step that decodes is sized by it instead (:mod:`worker.step_cost`), at most
        ``idle_prefill_tokens`` tokens."""
        self.max_prefill_tokens = max_prefill_tokens
        self.idle_prefill_tokens = max(max_prefill_tokens, idle_prefill_tokens)
        self.cost = cost

    # ---- requests in and out ----------------------------------------------------------

    def add(self, seq) -> None:
        """Queue a request (status ``WAITING``). Raises :class:`TooLarge` or :class:`QueueFull`."""
        if seq.max_tokens > self.capacity_tokens:
            raise TooLarge(
                f"request needs {seq.max_tokens} KV tokens (prompt {len(seq.prompt)} + max_tokens "
                f"{seq.max_output}) but this worker's KV cache holds {self.capacity_tokens} tokens"
            )
        if len(self.waiting) + len(self.running) >= self.max_num_seqs + self.max_waiting:
            raise QueueFull(f"worker is full: {len(self.running)} running, {len(self.waiting)} waiting")
        seq.arrival = next(self._arrivals)
        seq.queued_at = self.clock()
        seq.status = RequestStatus.WAITING
        self._enqueue(seq)

    def finish(self, seq, status: RequestStatus) -> None:
        """End a request, waiting or running, with a ``FINISHED_*`` ``status``: it leaves the queue
        or the running set now and its blocks are freed (full ones stay in the prefix cache)."""
        assert status.finished, status
        if seq in self.running:
            self.running.remove(seq)
            self._long.discard(seq.request_id)
            self.blocks.release(seq.table)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = status

    def drop_waiting(self, request_id: str):
        """Abort a request if it is waiting; return it (None when no waiting request has that id)."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.finish(seq, RequestStatus.FINISHED_ABORTED)
                return seq
        return None

    def retire(self, done: set[str]) -> list:
        """Finish the running sequences whose ids are in ``done`` (``FINISHED_STOPPED``); return them."""
        gone = [s for s in self.running if s.request_id in done]
        for seq in gone:
            self.finish(seq, RequestStatus.FINISHED_STOPPED)
        return gone

    # ---- one step ---------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Plan one step (see the module docstring). Mutates ``running``, ``waiting`` and block tables."""
        plan = StepPlan()
        self._expire(plan)
        self._plan_decodes(plan)
        self._beside = len(plan.decode)
        budget = self._step_budget()
        reserve = self._long_reserve(budget)
        left = self._continue_prefills(plan, budget - reserve, long=False)
        left = self._admit(plan, left, long=False)
        # a short prompt's forced token at the floor may overspend its part: the long part stays
        left = self._continue_prefills(plan, max(left, 0.0) + reserve, long=True)
        self._admit(plan, left, long=True)
        self.peak_running = max(self.peak_running, len(self.running))
        return plan

    def finish_step(self, plan: StepPlan) -> list:
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

    def redo_last_token(self, seqs: list) -> None:
        """Sampling failed after :meth:`finish_step` (out of memory): each of ``seqs`` computes its
        last token again next step (same slot, same values), so its logits come back."""
        for seq in seqs:
            seq.computed -= 1

    def back_off_after_oom(self, plan: StepPlan) -> OomBackOff:
        """Out of device memory in the step of ``plan``; nothing advanced (``computed`` moves only
        after a pass succeeds). Ask less of the next step: halve the prefill budgets when the step
        prefilled (down to one block), else preempt one running sequence, else (one sequence that
        cannot fit alone) abort it."""
        bs = self.blocks.block_size
        if plan.prefill and self.max_prefill_tokens > bs:  # sized in tokens from now on
            self.set_prefill_budget(max(bs, self.max_prefill_tokens // 2), self.idle_prefill_tokens // 2)
            return OomBackOff(prefill_tokens=self.max_prefill_tokens)
        if len(self.running) > 1:
            victim = self._victim()
            self.preempt(victim)
            return OomBackOff(preempted=victim)
        aborted = list(self.running)
        for seq in aborted:
            self.finish(seq, RequestStatus.FINISHED_ABORTED)
        return OomBackOff(aborted=aborted)

    def preempt(self, seq, plan: StepPlan | None = None) -> None:
        """Free a running sequence's blocks and queue it again (status ``PREEMPTED``, at its place
        in the order); it recomputes its tokens when readmitted."""
        plan = plan if plan is not None else StepPlan()
        self.running.remove(seq)
        self._long.discard(seq.request_id)
        self.blocks.release(seq.table)
        seq.computed = 0
        seq.preemptions += 1
        self.preemptions += 1
        plan.prefill[:] = [c for c in plan.prefill if c[0] is not seq]
        if seq in plan.decode:
            plan.decode.remove(seq)
        seq.queued_at = self.clock()
        seq.status = RequestStatus.PREEMPTED
        self._enqueue(seq)
        plan.preempted.append(seq)

    # ---- planning ---------------------------------------------------------------------

    def _plan_decodes(self, plan: StepPlan) -> None:
        """Every running sequence with one token to compute decodes it; one whose next block does
        not fit preempts another (:meth:`_victim`), or itself when it is the one to give way."""
        for seq in list(self.running):
            if seq not in self.running or seq.num_tokens - seq.computed != 1:
                continue
            while not self.blocks.grow(seq.table, seq.num_tokens):
                victim = self._victim()
                self.preempt(victim, plan)
                if victim is seq:
                    break
            else:
                plan.decode.append(seq)

    def _is_long(self, seq) -> bool:
        """A running sequence: whether it was admitted with more than the threshold to compute (a
        document's last chunks stay long); a waiting one: its whole length."""
        if seq in self.running:
            return seq.request_id in self._long
        return seq.num_tokens > self.shares.long_threshold

    def _long_prefills(self) -> list:
        return [s for s in self.running if s.num_tokens - s.computed > 1 and self._is_long(s)]

    def _step_budget(self) -> float:
        """This step's prefill budget: with nothing decoding ``idle_prefill_tokens`` tokens; beside
        decodes ``max_prefill_tokens`` tokens, or with a measured cost what keeps the step within its
        bound (token equivalents), at most ``idle_prefill_tokens`` and at least one (so prompts
        advance on a machine where even one token overruns the bound)."""
        if not self._beside:
            return self.idle_prefill_tokens
        if self.cost is None:
            return self.max_prefill_tokens
        return max(1.0, min(self.cost.budget(self._beside), self.idle_prefill_tokens))

    def _chunk(self, seq, limit: float) -> tuple[int, float]:
        """The next chunk of ``seq`` within ``limit`` of the step's budget: ``(tokens, spent)``. In
        tokens, or beside decodes with a measured cost in token equivalents (its attention over the
        keys before it counted), and then never less than one token while ``limit`` is positive, so
        a long prompt advances every step whatever its position."""
        left = seq.num_tokens - seq.computed
        if self.cost is None or not self._beside:
            n = max(0, min(left, int(limit)))
            return n, n
        n = min(left, max(1 if limit > 0 else 0, self.cost.tokens_within(seq.computed, limit)))
        return n, self.cost.weight(seq.computed, n)

    def _long_reserve(self, budget: float) -> float:
        """The part of ``budget`` kept for long prompts: ``long_share`` of it while one prefills or
        one waits with a long slot free, else nothing. At the floor of a measured cost (a budget of
        one token: even one token overruns the step's bound, as on a machine busy when it calibrated)
        the share stays a fraction, so short and long prompts each still take a token a step
        (:meth:`_chunk` gives any positive limit one token): a whole-token reserve would leave
        short prompts nothing while a long one prefills."""
        if not (self._long_prefills() or any(self._is_long(s) for s in self.waiting)):
            return 0
        reserve = min(budget, math.ceil(self.shares.long_share * budget))
        if reserve >= budget and self.cost is not None and self._beside:
            return self.shares.long_share * budget
        return reserve

    def _continue_prefills(self, plan: StepPlan, budget: float, long: bool) -> float:
        """Chunks for the running sequences still prefilling whose length class is ``long``; long
        ones split ``budget`` evenly. Returns what is left of ``budget``."""
        seqs = [s for s in self.running if s.num_tokens - s.computed > 1 and self._is_long(s) == long]
        share = max(1, budget // len(seqs)) if long and seqs else budget
        for seq in seqs:
            n, spent = self._chunk(seq, min(share, budget))
            if n <= 0:
                break
            plan.prefill.append((seq, seq.computed, seq.computed + n))
            budget -= spent
        return budget

    def _admit(self, plan: StepPlan, budget: float, long: bool) -> float:
        """Admit waiting sequences of one length class in order while the budget, the batch and the KV
        cache allow; each starts its prefill (or decodes, when its prompt was all cached). A long one
        that could start but does not fit the cache stops the short ones behind it too, so shorts do
        not take its memory for ever. Returns what is left of ``budget``."""
        for seq in list(self.waiting):
            if budget <= 0:
                break
            if self._is_long(seq) != long:
                if long or len(self._long_prefills()) >= self.shares.max_long or self._fits(seq):
                    continue
                break  # a long one that could start now waits only for memory: shorts queue behind it
            if long and len(self._long_prefills()) >= self.shares.max_long:
                break
            if not self._take_seat(seq, plan) or not self._make_room(seq, plan):
                break
            budget = self._start(seq, plan, budget)
        return budget

    def _take_seat(self, seq, plan: StepPlan) -> bool:
        """Whether ``seq`` has a place in the batch (fewer than ``max_num_seqs`` run), after
        preempting running flex sequences (newest first) for an interactive one: a batch's lines
        must not hold every seat while a colleague's question waits for one to end."""
        while len(self.running) >= self.max_num_seqs:
            flex = [s for s in self.running if s.flex] if not seq.flex else []
            if not flex:
                return False
            self.preempt(flex[-1], plan)
        return True

    def _fits(self, seq) -> bool:
        use_cache = not getattr(seq, "needs_prompt_logprobs", False)
        return self.blocks.can_allocate(seq.token_ids, reserve=len(self.running), use_cache=use_cache)

    def _make_room(self, seq, plan: StepPlan) -> bool:
        """Whether ``seq`` fits the cache now, after preempting running flex sequences (newest first)
        for an interactive one."""
        while not self._fits(seq):
            flex = [s for s in self.running if s.flex] if not seq.flex else []
            if not flex:
                return False
            self.preempt(flex[-1], plan)
        return True

    def _start(self, seq, plan: StepPlan, budget: float) -> float:
        """Admit ``seq`` (it fits): allocate its blocks, plan its first chunk. Returns the budget left."""
        use_cache = not getattr(seq, "needs_prompt_logprobs", False)
        self.waiting.remove(seq)
        seq.table, seq.computed = self.blocks.allocate(seq.token_ids, use_cache=use_cache)
        if not seq.preemptions:  # a re-admission finds its own blocks: not a hit of the prompt
            seq.cached_at_admission = seq.computed
        seq.status = RequestStatus.RUNNING
        self.running.append(seq)
        left = seq.num_tokens - seq.computed
        if left > self.shares.long_threshold:
            self._long.add(seq.request_id)
        if left == 1:
            plan.decode.append(seq)
            return budget - 1
        n, spent = self._chunk(seq, budget)
        plan.prefill.append((seq, seq.computed, seq.computed + n))
        return budget - spent

    def _victim(self):
        """The running sequence to give way first: flex, then the highest ``priority`` value, then
        the latest admitted (vLLM's priority policy; plain FCFS preempts the newest)."""
        order = {id(s): i for i, s in enumerate(self.running)}
        return max(self.running, key=lambda s: (s.flex, s.priority, order[id(s)]))

    @staticmethod
    def _rank(seq) -> tuple:
        return (seq.flex, seq.priority, seq.arrival)

    def _enqueue(self, seq) -> None:
        bisect.insort(self.waiting, seq, key=self._rank)

    def _expire(self, plan: StepPlan) -> None:
        now = self.clock()
        late = [s for s in self.waiting if now - s.queued_at > self.max_queue_wait_s]
        for seq in late:
            self.finish(seq, RequestStatus.FINISHED_ABORTED)
        plan.expired += late
