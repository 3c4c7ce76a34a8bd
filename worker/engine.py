"""The worker's engine: continuous batching over a padded, preallocated KV cache (iteration-level scheduling).

Each :meth:`Engine.step` (1) drops cancelled sequences, (2) admits waiting requests that fit the
KV budget (:mod:`worker.scheduler`) and prefills them straight into free rows of the running batch,
(3) runs one decode step for every running sequence, (4) emits each sequence's text delta and
retires the finished ones at once, so their rows and KV memory go to the next newcomer. Nobody
waits for a batch to drain: a newcomer's first token comes from its own prefill, one step after it
arrived.

Why this design (TGI's early padded batch for plain HF models, :mod:`worker.batch`) and not
transformers' ``init_continuous_batching`` manager: it runs any ``AutoModelForCausalLM`` through its
own forward pass on CPU and GPU alike, with no paged-attention kernel; it keeps the admission policy
(KV budget, FCFS, backpressure) in our own unit-tested scheduler; and measured, it is faster. On the
project's 2-core CPU box with SmolLM2-135M (float32, 256-token prompts, 64 new tokens), batch-8
decode steps went from ~90 ms to ~47 ms through two levers found by profiling:

* the KV cache: a preallocated buffer with a write cursor instead of ``DynamicCache``'s
  ``torch.cat`` per layer per step (the cat was 43% of a batch-8 step);
* the weights: decode is bound by reading them, and MKL's sgemm reads skinny [8, 576] x [576, N]
  products at ~9 GB/s; oneDNN with the weights prepacked once (:func:`prepack_linears`) at ~26 GB/s.

Served over HTTP with 64 output tokens (``llamadeploy bench``, README "Benchmarks"), concurrency 8
gives 3.4x (256-token prompts) and 5.3x (short chat prompts) our concurrency-1 throughput, 1.3x and
1.5x a static ``model.generate`` batch of the same prompts, and 1.9x and 1.7x
``transformers serve --continuous_batching`` on the same box. The cost of padding: a step attends
over the longest row for every row, which is small next to the weight reads (attention is ~15% of
a step). On CPU newcomers are prefilled one per step (see :mod:`worker.scheduler` for why).
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Callable

import torch

from worker.batch import PaddedBatch
from worker.protocol import Failed, Generate, Msg
from worker.sampling import sample_batch
from worker.scheduler import QueueFull, Scheduler, TooLarge
from worker.sequence import Sequence

log = logging.getLogger(__name__)


class Engine:
    """Owns the model, the running batch and the scheduler. Single-threaded: call from one thread.

    ``emit`` receives every outgoing message (:class:`~worker.protocol.Tokens`, ``Failed``). On CPU
    the model's linear layers are replaced in place by oneDNN-prepacked ones (:func:`prepack_linears`).
    """

    def __init__(self, model, tokenizer, scheduler: Scheduler, max_model_len: int,
                 emit: Callable[[Msg], None], device: torch.device, prepack: bool = True):
        if prepack and device.type == "cpu":
            prepack_linears(model)
        self.model = model
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.emit = emit
        self.device = device
        self.batch = PaddedBatch(model, device, scheduler.max_num_seqs)
        self.next_tokens: list[int] = []
        self.by_id: dict[str, Sequence] = {}
        self.served = 0
        self._last_trim = 0.0
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
        p = gen.params
        if not (0.0 <= p.temperature <= 2.0 and 0.0 < p.top_p <= 1.0 and p.top_k >= 0):  # NaN fails them all
            self.emit(Failed(request_id=gen.request_id, code=400, message="sampling parameters out of range"))
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
        if self.scheduler.running:
            ids = torch.tensor(self.next_tokens, dtype=torch.long, device=self.device)
            logits = self.batch.decode(self.model, ids)
            self._sample(self.scheduler.running, logits)
            self._retire()

    def _prefill(self, newcomers: list[Sequence]) -> None:
        logits = self.batch.add(self.model, [s.prompt for s in newcomers], [s.worst_case_tokens for s in newcomers],
                                self.pad_id)
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
        self.next_tokens = [self.next_tokens[i] for i in keep]
        self.batch.filter(keep)
        if not keep:
            self._trim_heap()
        for rid in done:
            seq = self.by_id.pop(rid)
            self.served += not seq.cancelled
            if log.isEnabledFor(logging.DEBUG):
                log.debug("request %s %s after %d tokens; running %d; memory %d bytes", rid,
                          "cancelled" if seq.cancelled else seq.finish_reason, len(seq.output), len(keep),
                          memory_bytes(self.device))

    def _trim_heap(self) -> None:
        """The batch emptied: give the allocator's free pages back to the OS (at most once a second)."""
        now = time.monotonic()
        if now - self._last_trim >= 1.0:
            self._last_trim = now
            trim_heap()

    def stats(self) -> dict:
        """Counters for the heartbeat: running, waiting, reserved KV tokens, peak running, served, memory bytes."""
        s = self.scheduler
        return {"running": len(s.running), "waiting": len(s.waiting), "kv_used_tokens": s.reserved_tokens,
                "peak_running": s.peak_running, "served": self.served, "mem_bytes": memory_bytes(self.device)}


class PackedLinear(torch.nn.Module):
    """``nn.Linear`` with its weight reordered once into oneDNN's blocked layout (what inductor's
    weight freezing does on CPU). MKL's sgemm reads a [8, 576] x [576, 1536] weight at ~9 GB/s on
    this project's 2-core box; the prepacked oneDNN kernel at ~26 GB/s, and decode is bound by
    reading the weights, so a batch-8 decode step went from ~90 ms to ~47 ms."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            self.weight_packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in_features]
        return torch.ops.mkldnn._linear_pointwise(x, self.weight_packed, self.bias, "none", [], "")


def prepack_linears(model) -> int:
    """Swap every float32/bfloat16 ``nn.Linear`` of a CPU model for a :class:`PackedLinear`.

    Checks the packed kernel against ``F.linear`` first and leaves the model alone if it is missing
    or disagrees (another torch build). Returns the number of layers swapped.
    """
    linears = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is torch.nn.Linear and child.weight.device.type == "cpu"
               and child.weight.dtype in (torch.float32, torch.bfloat16)]
    if not linears or not _packed_kernel_ok(linears[0][2]):
        return 0
    for parent, name, child in linears:
        setattr(parent, name, PackedLinear(child))
    with torch.no_grad():  # what is left (embeddings, norms) gets its own memory, so the loader's
        for param in model.parameters():  # mapping of the weights file and the unpacked copies go away
            param.data = param.data.clone()
    log.info("prepacked %d linear layers for oneDNN", len(linears))
    return len(linears)


def _packed_kernel_ok(linear: torch.nn.Linear) -> bool:
    try:
        with torch.inference_mode():
            x = torch.randn(3, linear.in_features, dtype=linear.weight.dtype)
            got = PackedLinear(linear)(x)
            want = torch.nn.functional.linear(x, linear.weight, linear.bias)
            return bool(torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2))
    except (RuntimeError, AttributeError) as exc:
        log.info("oneDNN prepacked linear unavailable (%s); using the model as loaded", exc)
        return False


def trim_heap() -> None:
    """``malloc_trim(0)``: return freed heap pages (activations of past steps) to the OS. glibc only."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def memory_bytes(device: torch.device) -> int:
    """Device memory in use: ``torch.cuda.memory_allocated`` on GPU, this process's RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
