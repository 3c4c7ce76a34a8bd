"""The worker's engine loop body: continuous batching with chunked prefill over a block KV cache.

Each :meth:`Engine.step` (1) asks the scheduler for this step's work — decodes first, then short
prompts, then long prompts' chunks, newcomers admitted by need in priority order, a sequence
preempted if the cache runs out (:mod:`worker.scheduler`), (2) runs one forward pass over all of it
(:mod:`worker.runner`), (3) samples the sequences whose tokens are all computed and has the
scheduler finish the ones that ended, and (4) returns the step's messages (vLLM's
``EngineCore.step``): the caller sends them. The scheduler is the only writer of a request's state;
the engine asks it by name (``add``, ``finish``, ``back_off_after_oom``, ``redo_last_token``).

GPU faults are contained here, not in the process: after an out-of-memory error in the forward pass
the allocator's cache is freed and the scheduler backs off (halves the prefill budget, or preempts a
sequence, or aborts a lone one that cannot fit: 503), and the step is retried by the next loop
iteration; a row whose logits are not finite fails that request (500), never the worker.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time

import torch

from worker.contract.protocol import EngineLoad, Generate, Msg
from worker.core import failed
from worker.cpu_share import ThreadGovernor
from worker.request import RequestStatus
from worker.runner import ModelRunner
from worker.sampling import MAX_TOP_LOGPROBS, SamplingError, sample_batch_ex
from worker.scheduler import QueueFull, Scheduler, StepPlan, TooLarge
from worker.sequence import Sequence

log = logging.getLogger(__name__)


class Engine:
    """Owns the runner (model + KV cache), the scheduler and every sequence. Single-threaded; an
    :class:`~worker.core.EngineCore`. :meth:`submit` and :meth:`step` return the messages to send
    (:class:`~worker.contract.protocol.Tokens`, ``Failed``); the caller sends them. Every change of
    a request's state goes through the scheduler's methods."""

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer,
        scheduler: Scheduler,
        max_model_len: int,
        device: torch.device,
        vocab_size: int,
        eos_ids: set[int],
        governor: ThreadGovernor | None = None,
    ):
        self.runner = runner
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.device = device
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.governor = governor  # a CPU worker's compute threads (worker.cpu_share); None: fixed
        self.by_id: dict[str, Sequence] = {}
        self.served = 0
        self.steps = 0
        self.last_step_at = time.monotonic()
        self.oom_events = 0
        self._last_trim = 0.0
        self._last_shape = (0, 0, 0, 0.0, 0.0, 0.0)  # decodes, prefill chunks, their tokens; its phases' seconds

    # ---- requests in ------------------------------------------------------------------

    def submit(self, gen: Generate) -> list[Msg]:
        """Queue a request; returns ``[Failed]`` when it is invalid, too large or the queue is full."""
        rid = gen.request_id
        if rid in self.by_id:
            return [failed(rid, 400, "duplicate request_id")]
        output = list(gen.output_token_ids or [])
        if problem := self._check(gen, output):
            return [failed(rid, 400, problem)]
        try:
            seq = Sequence(
                rid,
                list(gen.prompt_token_ids),
                gen.params,
                self.tokenizer,
                self.eos_ids,
                self.max_model_len,
                self.device,
                self.vocab_size,
                output=output,
                priority=gen.priority,
                flex=gen.flex,
            )
        except SamplingError as exc:
            return [failed(rid, 400, str(exc))]
        if output and len(output) >= seq.max_output:
            return [failed(rid, 400, f"{len(output)} tokens already generated, max_tokens is {seq.max_output}")]
        try:
            self.scheduler.add(seq)
        except QueueFull as exc:
            return [failed(rid, 429, str(exc), retry_after_s=1.0)]
        except TooLarge as exc:
            return [failed(rid, 400, str(exc))]
        self.by_id[rid] = seq
        return []

    def _check(self, gen: Generate, output: list[int]) -> str | None:
        """Why ``gen`` cannot be served (a 400's message), or None."""
        ids = gen.prompt_token_ids
        if not ids or any(t < 0 or t >= self.vocab_size for t in [*ids, *output]):
            return "prompt token ids empty or out of vocabulary"
        if len(ids) + len(output) >= self.max_model_len or gen.params.max_tokens < 1:
            return f"prompt of {len(ids) + len(output)} tokens leaves no room in max_model_len {self.max_model_len}"
        p = gen.params
        if not (0.0 <= p.temperature <= 2.0 and 0.0 <= p.top_p <= 1.0 and p.top_k >= 0):  # NaN fails them all
            return "sampling parameters out of range"
        if p.prompt_logprobs is not None and not 0 <= p.prompt_logprobs <= MAX_TOP_LOGPROBS:
            return f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}]"
        return None

    def cancel(self, request_id: str) -> None:
        """Stop a request now, waiting or running: it is aborted and its blocks freed."""
        seq = self.by_id.get(request_id)
        if seq is not None:
            self._end(seq, RequestStatus.FINISHED_ABORTED)

    # ---- the loop body ----------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    def in_flight(self) -> list[str]:
        """The ids of every request held, waiting or running."""
        return list(self.by_id)

    def idle(self) -> None:
        """The loop's turn hook: the runner's tensor-parallel keep-alive; the thread governor's
        observation of the turn (stepping while there is work)."""
        self.runner.idle()
        if self.governor is not None:
            self.governor.observe(self.has_work)

    def step(self) -> list[Msg]:
        """One iteration: schedule, one forward pass, sample, finish what ended. Returns the step's
        messages: a ``Tokens`` per sampled sequence, a ``Failed`` per request that failed."""
        out: list[Msg] = []
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        for seq in plan.expired:
            self._forget(seq)
            wait = self.scheduler.max_queue_wait_s
            out.append(
                failed(seq.request_id, 503, f"waited longer than {wait:g}s for KV cache memory; retry later", 5.0)
            )
        if plan.empty:
            self._last_shape = (0, 0, 0, time.perf_counter() - t0, 0.0, 0.0)
            return out
        t1 = time.perf_counter()
        try:
            logits = self.runner.run(plan)
        except torch.OutOfMemoryError as exc:
            if not self.runner.oom_recoverable:
                raise  # tensor parallel: the other ranks cannot retry in step; the replica restarts
            return out + self._on_oom(plan, exc)
        self.steps += 1
        self.last_step_at = time.monotonic()
        t2 = time.perf_counter()
        ready = self.scheduler.finish_step(plan)
        try:
            out += self._sample(ready, logits)
        except torch.OutOfMemoryError as exc:
            self.scheduler.redo_last_token(ready)
            out += self._on_oom(StepPlan(decode=ready), exc)
        tokens = sum(e - s for _, s, e in plan.prefill)
        self._last_shape = (len(plan.decode), len(plan.prefill), tokens, t1 - t0, t2 - t1, time.perf_counter() - t2)
        return out

    def last_step(self) -> str:
        """The last step's batch (its decodes, prefill chunks and their tokens), the wall time of its
        three phases, and what is left."""
        decodes, chunks, tokens, plan_s, forward_s, sample_s = self._last_shape
        s = self.scheduler
        return (
            f"step {self.steps}: {decodes} decodes, {chunks} prefill chunks of {tokens} tokens "
            f"(schedule {1e3 * plan_s:.0f} ms, forward {1e3 * forward_s:.0f} ms, sample {1e3 * sample_s:.0f} ms); "
            f"{len(s.running)} running, {len(s.waiting)} waiting"
        )

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[Msg]:
        """Sample every sequence whose tokens are all computed (``logits`` [N, V]); a row the sampler
        cannot sample (non-finite logits, a grammar with no allowed token) fails that request alone."""
        result = sample_batch_ex(logits, [s.sampler for s in seqs])
        out: list[Msg] = []
        for i, (seq, token) in enumerate(zip(seqs, result.token_ids, strict=True)):
            if i in result.bad_rows:
                log.error(
                    "request %s: cannot sample at position %d (%s); failing it",
                    seq.request_id,
                    seq.num_tokens,
                    result.bad_rows[i],
                )
                self._end(seq, RequestStatus.FINISHED_ABORTED)
                out.append(failed(seq.request_id, 500, result.bad_rows[i]))
                continue
            seq.sampler.accept(token)
            msg = seq.append(token)
            out.append(msg)
            if msg.finish_reason is not None:
                self._end(seq, RequestStatus.for_finish_reason(msg.finish_reason))
        return out

    def _on_oom(self, plan: StepPlan, exc: Exception) -> list[Msg]:
        """Out of device memory in the forward pass or the sampler: the scheduler backs off (smaller
        prefill, one sequence preempted, or a lone one that cannot fit aborted: 503); the next step
        retries."""
        self.oom_events += 1
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        running = len(self.scheduler.running)
        backed = self.scheduler.back_off_after_oom(plan)
        if backed.prefill_tokens is not None:
            prefill = sum(e - b for _, b, e in plan.prefill)
            log.warning(
                "out of memory in a step with %d prefill tokens; prefill budget now %d tokens (%s)",
                prefill,
                backed.prefill_tokens,
                exc,
            )
        elif backed.preempted is not None:
            log.warning(
                "out of memory decoding %d sequences; preempted request %s (%s)",
                running,
                backed.preempted.request_id,
                exc,
            )
        message = "out of device memory for this request alone; retry later"
        for seq in backed.aborted:
            self._forget(seq)
        return [failed(s.request_id, 503, message, retry_after_s=5.0) for s in backed.aborted]

    def _end(self, seq: Sequence, status: RequestStatus) -> None:
        """The scheduler finishes ``seq`` with ``status``; the engine forgets it."""
        self.scheduler.finish(seq, status)
        self._forget(seq)

    def _forget(self, seq: Sequence) -> None:
        """Drop a finished request from the table (counted as served unless aborted)."""
        del self.by_id[seq.request_id]
        self.served += seq.status is not RequestStatus.FINISHED_ABORTED
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "request %s %s after %d tokens (%d cached at admission, %d preemptions); memory %d bytes",
                seq.request_id,
                seq.status.value,
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
            compute_threads=self.governor.threads if self.governor else 0,
            thread_changes=self.governor.changes if self.governor else 0,
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
