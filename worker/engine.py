"""The worker's engine loop body: continuous batching with chunked prefill over a block KV cache.

Each :meth:`Engine.step` (1) retires cancelled sequences, (2) asks the scheduler for this step's
work — every running sequence decodes one token, prompt chunks fill the prefill budget, newcomers
are admitted by need, the newest is preempted if the cache runs out (:mod:`worker.scheduler`),
(3) runs one forward pass over all of it (:mod:`worker.runner`), (4) samples the sequences whose
tokens are all computed, emits their text deltas and retires the finished ones at once.

GPU faults are contained here, not in the process: an out-of-memory error in the forward pass
frees the allocator's cache, halves the prefill budget and preempts the newest sequence (or fails
a lone one that cannot fit, 503), and the step is retried by the next loop iteration; a row whose
logits are not finite fails that request (500), never the worker.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Callable

import torch

from worker.contract.protocol import EngineLoad, Failed, Generate, Msg
from worker.runner import ModelRunner
from worker.sampling import MAX_TOP_LOGPROBS, SamplingError, sample_batch_ex
from worker.scheduler import Plan, QueueFull, Scheduler, TooLarge
from worker.sequence import Sequence

log = logging.getLogger(__name__)


class Engine:
    """Owns the runner (model + KV cache), the scheduler and every sequence. Single-threaded.

    ``emit`` receives every outgoing message (:class:`~worker.contract.protocol.Tokens`, ``Failed``).
    """

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer,
        scheduler: Scheduler,
        max_model_len: int,
        emit: Callable[[Msg], None],
        device: torch.device,
        vocab_size: int,
        eos_ids: set[int],
    ):
        self.runner = runner
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.emit = emit
        self.device = device
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.by_id: dict[str, Sequence] = {}
        self.served = 0
        self.steps = 0
        self.last_step_at = time.monotonic()
        self.oom_events = 0
        self._last_trim = 0.0

    # ---- requests in ------------------------------------------------------------------

    def submit(self, gen: Generate) -> None:
        """Queue a request; answers ``Failed`` at once if it is invalid, too large or the queue is full."""
        rid = gen.request_id
        if rid in self.by_id:
            return self._fail(rid, 400, "duplicate request_id")
        ids = list(gen.prompt_token_ids)
        output = list(getattr(gen, "output_token_ids", None) or [])
        if not ids or any(t < 0 or t >= self.vocab_size for t in ids + output):
            return self._fail(rid, 400, "prompt token ids empty or out of vocabulary")
        if len(ids) + len(output) >= self.max_model_len or gen.params.max_tokens < 1:
            return self._fail(
                rid,
                400,
                f"prompt of {len(ids) + len(output)} tokens leaves no room in max_model_len {self.max_model_len}",
            )
        p = gen.params
        if not (0.0 <= p.temperature <= 2.0 and 0.0 <= p.top_p <= 1.0 and p.top_k >= 0):  # NaN fails them all
            return self._fail(rid, 400, "sampling parameters out of range")
        if p.prompt_logprobs is not None and not 0 <= p.prompt_logprobs <= MAX_TOP_LOGPROBS:
            return self._fail(rid, 400, f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
        try:
            seq = Sequence(
                rid,
                ids,
                p,
                self.tokenizer,
                self.eos_ids,
                self.max_model_len,
                self.device,
                self.vocab_size,
                output=output,
            )
        except SamplingError as exc:
            return self._fail(rid, 400, str(exc))
        if output and len(output) >= seq.max_output:
            return self._fail(rid, 400, f"{len(output)} tokens already generated, max_tokens is {seq.max_output}")
        try:
            self.scheduler.add(seq)
        except QueueFull as exc:
            return self._fail(rid, 429, str(exc), retry_after_s=1.0)
        except TooLarge as exc:
            return self._fail(rid, 400, str(exc))
        self.by_id[rid] = seq

    def cancel(self, request_id: str) -> None:
        """Stop a request: a waiting one is dropped now, a running one leaves at the next step."""
        seq = self.by_id.get(request_id)
        if seq is None:
            return
        seq.cancelled = True
        if self.scheduler.drop_waiting(request_id) is not None:
            del self.by_id[request_id]

    # ---- the loop body ----------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    def step(self) -> None:
        """One iteration: retire cancelled, schedule, one forward pass, sample, retire finished."""
        self._retire()
        plan = self.scheduler.schedule()
        for seq in plan.expired:
            del self.by_id[seq.request_id]
            self._fail(
                seq.request_id,
                503,
                f"waited longer than {self.scheduler.max_queue_wait_s:g}s for KV cache memory; retry later",
                retry_after_s=5.0,
            )
        if plan.empty:
            return
        try:
            logits = self.runner.run(plan)
        except torch.OutOfMemoryError as exc:
            if not self.runner.oom_recoverable:
                raise  # tensor parallel: the other ranks cannot retry in step; the replica restarts
            self._on_oom(plan, exc)
            return
        self.steps += 1
        self.last_step_at = time.monotonic()
        ready = self.scheduler.finish_step(plan)
        try:
            self._sample(ready, logits)
        except torch.OutOfMemoryError as exc:
            for seq in ready:  # their last token is computed again next step (same slot, same values)
                seq.computed -= 1
            self._on_oom(Plan(decode=ready), exc)
        self._retire()

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Sample every sequence whose tokens are all computed (``logits`` [N, V]); a row the sampler
        cannot sample (non-finite logits, a grammar with no allowed token) fails that request alone."""
        result = sample_batch_ex(logits, [s.sampler for s in seqs])
        for i, (seq, token) in enumerate(zip(seqs, result.token_ids, strict=True)):
            if seq.cancelled:
                continue
            if i in result.bad_rows:
                log.error(
                    "request %s: cannot sample at position %d (%s); failing it",
                    seq.request_id,
                    seq.num_tokens,
                    result.bad_rows[i],
                )
                seq.cancelled = True
                self._fail(seq.request_id, 500, result.bad_rows[i])
                continue
            seq.sampler.accept(token)
            self.emit(seq.append(token))

    def _on_oom(self, plan: Plan, exc: Exception) -> None:
        """Out of device memory in the forward pass: nothing advanced (``computed`` moves only after
        a pass succeeds), so shrink what a step asks for and let the next step retry."""
        self.oom_events += 1
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        s = self.scheduler
        if plan.prefill and s.max_prefill_tokens > s.blocks.block_size:
            s.max_prefill_tokens = max(s.blocks.block_size, s.max_prefill_tokens // 2)
            s.idle_prefill_tokens = max(s.max_prefill_tokens, s.idle_prefill_tokens // 2)
            log.warning(
                "out of memory in a step with %d prefill tokens; prefill budget now %d tokens (%s)",
                sum(e - b for _, b, e in plan.prefill),
                s.max_prefill_tokens,
                exc,
            )
        elif len(s.running) > 1:
            victim = s.running[-1]
            s.preempt(victim)
            log.warning(
                "out of memory decoding %d sequences; preempted request %s (%s)",
                len(s.running) + 1,
                victim.request_id,
                exc,
            )
        else:
            for seq in list(s.running):
                seq.cancelled = True
                self._fail(
                    seq.request_id, 503, "out of device memory for this request alone; retry later", retry_after_s=5.0
                )
            self._retire()

    def _fail(self, request_id: str, code: int, message: str, retry_after_s: float | None = None) -> None:
        self.emit(Failed(request_id=request_id, code=code, message=message, retry_after_s=retry_after_s))

    def _retire(self) -> None:
        done = {s.request_id for s in self.scheduler.running if s.finished}
        if not done:
            return
        self.scheduler.retire(done)
        for rid in done:
            seq = self.by_id.pop(rid)
            self.served += not seq.cancelled
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "request %s %s after %d tokens (%d cached at admission, %d preemptions); memory %d bytes",
                    rid,
                    "cancelled" if seq.cancelled else seq.finish_reason,
                    len(seq.output),
                    seq.cached_at_admission,
                    seq.preemptions,
                    memory_bytes(self.device),
                )
        if not self.scheduler.running:
            self._trim_heap()

    def _trim_heap(self) -> None:
        """The batch emptied: give the allocator's free pages back to the OS (at most once a second)."""
        now = time.monotonic()
        if now - self._last_trim >= 1.0:
            self._last_trim = now
            trim_heap()

    def stats(self) -> EngineLoad:
        """This engine's figures now (the heartbeat's load): load, KV blocks, prefix-cache hits,
        progress of the loop, memory."""
        s, b = self.scheduler, self.scheduler.blocks
        return EngineLoad(
            running=len(s.running),
            waiting=len(s.waiting),
            kv_used_tokens=s.reserved_tokens,
            peak_running=s.peak_running,
            finished=self.served,
            mem_bytes=memory_bytes(self.device),
            steps=self.steps,
            last_step_age_s=time.monotonic() - self.last_step_at,
            cpu_s=time.process_time(),  # the router tells a slow step (computing) from a hung one by it
            prefix_hit_tokens=b.hit_tokens,
            prefix_queried_tokens=b.queried_tokens,
            kv_blocks_total=b.num_blocks,
            kv_blocks_free=b.num_free,
            preemptions=s.preemptions,
            **self.runner.step_counts(),
        )


def trim_heap() -> None:
    """``malloc_trim(0)``: return freed heap pages (activations of past steps) to the OS. glibc only."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def memory_bytes(device: torch.device) -> int:
    """Memory this worker holds: reserved by torch's allocator over its visible GPUs, RSS on CPU."""
    if device.type == "cuda":
        from worker.gpus import memory_reserved_total

        return memory_reserved_total()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
