"""The worker's engine: continuous batching over a padded KV cache (iteration-level scheduling).

Each :meth:`Engine.step` (1) drops cancelled sequences, (2) admits waiting requests that fit the
KV budget and prefills them as one batch, concatenating them onto the running batch, (3) runs one
decode step for every running sequence, (4) emits each sequence's text delta and retires the
finished ones at once, so their slots and KV memory go to the next newcomer.

Why this design and not transformers' ``init_continuous_batching`` manager: it needs no paged
attention kernel, runs any ``AutoModelForCausalLM`` on CPU and GPU alike, keeps the admission
policy (KV budget, FCFS, backpressure) in our own testable :mod:`worker.scheduler`, and measured
on par with or faster than ``transformers serve --continuous_batching`` for the small models we
test on (see README, "Benchmarks"). Its cost is padding: rows pay for the longest row's length.
"""

from __future__ import annotations

import logging
import os
from typing import Callable

import torch

from worker.batch import PaddedBatch, prefill
from worker.protocol import Failed, Generate, Msg
from worker.sampling import sample_batch
from worker.scheduler import QueueFull, Scheduler, TooLarge
from worker.sequence import Sequence

log = logging.getLogger(__name__)


class Engine:
    """Owns the model, the running batch and the scheduler. Single-threaded: call from one thread.

    ``emit`` receives every outgoing message (:class:`~worker.protocol.Tokens`, ``Failed``).
    """

    def __init__(self, model, tokenizer, scheduler: Scheduler, max_model_len: int,
                 emit: Callable[[Msg], None], device: torch.device):
        self.model = model
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.emit = emit
        self.device = device
        self.batch: PaddedBatch | None = None
        self.next_tokens: list[int] = []
        self.by_id: dict[str, Sequence] = {}
        self.served = 0
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.eos_ids = set(eos) if isinstance(eos, list) else {eos}
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(self.eos_ids))

    # ---- requests in ------------------------------------------------------------------

    def submit(self, gen: Generate) -> None:
        """Queue a request; answers ``Failed`` at once if it is invalid or the queue is full."""
        if gen.request_id in self.by_id:
            self.emit(Failed(request_id=gen.request_id, code=400, message="duplicate request_id"))
            return
        vocab = self.model.config.vocab_size
        if not gen.prompt_token_ids or any(t < 0 or t >= vocab for t in gen.prompt_token_ids):
            self.emit(Failed(request_id=gen.request_id, code=400, message="prompt token ids empty or out of vocabulary"))
            return
        if len(gen.prompt_token_ids) >= self.max_model_len or gen.params.max_tokens < 1:
            self.emit(Failed(request_id=gen.request_id, code=400,
                             message=f"prompt of {len(gen.prompt_token_ids)} tokens leaves no room in max_model_len {self.max_model_len}"))
            return
        seq = Sequence(gen.request_id, list(gen.prompt_token_ids), gen.params, self.tokenizer,
                       self.eos_ids, self.max_model_len, self.device)
        try:
            self.scheduler.add(seq)
        except QueueFull as exc:
            self.emit(Failed(request_id=gen.request_id, code=429, message=str(exc)))
            return
        except TooLarge as exc:
            self.emit(Failed(request_id=gen.request_id, code=400, message=str(exc)))
            return
        self.by_id[seq.request_id] = seq

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
        """One iteration: retire cancelled, admit + prefill newcomers, decode the batch once."""
        self._retire()
        newcomers = self.scheduler.admit()
        if newcomers:
            self._prefill(newcomers)
            self._retire()
        if self.batch is not None and self.scheduler.running:
            ids = torch.tensor(self.next_tokens, dtype=torch.long, device=self.device)
            logits = self.batch.decode(self.model, ids)
            self._sample(self.scheduler.running, logits)
            self._retire()

    def _prefill(self, newcomers: list[Sequence]) -> None:
        new_batch, logits = prefill(self.model, [s.prompt for s in newcomers], self.pad_id, self.device)
        if self.batch is None:
            self.batch, self.next_tokens = new_batch, []
        else:
            self.batch.merge(new_batch)
        self.next_tokens.extend([0] * len(newcomers))
        self._sample(newcomers, logits, offset=len(self.next_tokens) - len(newcomers))

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, offset: int = 0) -> None:
        tokens = sample_batch(logits, [s.sampler for s in seqs])
        for i, (seq, token) in enumerate(zip(seqs, tokens)):
            self.next_tokens[offset + i] = token
            if seq.cancelled:
                continue
            msg = seq.append(token)
            if msg is not None:
                self.emit(msg)

    def _retire(self) -> None:
        done = {s.request_id for s in self.scheduler.running if s.finished}
        if not done:
            return
        keep = self.scheduler.retire(done)
        for rid in done:
            seq = self.by_id.pop(rid)
            self.served += not seq.cancelled
        self.next_tokens = [self.next_tokens[i] for i in keep]
        if keep:
            self.batch.filter(keep)
        else:
            self.batch = None
        log.debug("retired %d, running %d, memory %d bytes", len(done), len(keep), memory_bytes(self.device))

    def stats(self) -> dict:
        """Counters for the heartbeat: running, waiting, reserved KV tokens, peak running, served, memory bytes."""
        s = self.scheduler
        return {"running": len(s.running), "waiting": len(s.waiting), "kv_used_tokens": s.reserved_tokens,
                "peak_running": s.peak_running, "served": self.served, "mem_bytes": memory_bytes(self.device)}


def memory_bytes(device: torch.device) -> int:
    """Device memory in use: ``torch.cuda.memory_allocated`` on GPU, this process's RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
