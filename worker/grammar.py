"""Grammar-constrained decoding with xgrammar: compile once per (tokenizer, grammar), match per row.

The router has already validated and compiled every grammar it sends (``router.structured``), so
a compile here cannot fail on a hostile schema; it is still done off the engine loop (a compile
takes milliseconds to tens of milliseconds, and releases the GIL). Shipping the compiled grammar
instead does not pay: deserializing it (``CompiledGrammar.deserialize_json``) costs about what
compiling does (the measurements are in the docs' benchmark results). So the router sends the grammar's source (:class:`worker.contract.protocol.Grammar`)
and each worker compiles it on a background thread when the request arrives, into a bounded LRU
cache keyed by the source (the router canonicalises schemas, so equal schemas share an entry).
The first decode step of the row waits for the compile only if it is still running then (a prefill
usually takes longer than the compile).

Per row, :class:`RowGrammar` holds an ``xgrammar.GrammarMatcher``: the sampler fills the row's
token bitmask before sampling and advances the matcher on every accepted token. When the value is
complete the matcher allows only the stop tokens, so the row ends with ``finish_reason: "stop"``
right there; a row cut by ``max_tokens`` ends with ``"length"`` as any other.

Set-up: the worker calls :func:`configure` once after loading the tokenizer (before any request);
:func:`worker.sampling.RowSampler.from_params` then finds the compiler through :func:`grammars`.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from worker.contract.grammar import GrammarError, compile_grammar, tokenizer_info
from worker.contract.protocol import Grammar

log = logging.getLogger(__name__)

CACHE_ENTRIES = 256  # compiled grammars kept per worker (least recently used dropped first)


class Grammars:
    """The compiled-grammar cache of one tokenizer. Thread-safe; compiles on one background thread."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], entries: int = CACHE_ENTRIES):
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.entries = entries
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")

    def submit(self, spec: Grammar) -> Future:
        """The compiled grammar of ``spec`` as a future (already done on a cache hit)."""
        key = (spec.kind, spec.strict, spec.source)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None and not (fut.done() and fut.exception() is not None):
                self._cache.move_to_end(key)
                return fut
            fut = self._pool.submit(compile_grammar, self.compiler, spec)
            self._cache[key] = fut
            while len(self._cache) > self.entries:
                self._cache.popitem(last=False)
            return fut

    def matcher(self, spec: Grammar) -> RowGrammar:
        return RowGrammar(self.submit(spec), self.vocab_size)


_grammars: Grammars | None = None


def configure(tokenizer, vocab_size: int, stop_token_ids) -> Grammars:
    """Install this process's grammar compiler (the worker calls it once after loading its tokenizer)."""
    global _grammars
    _grammars = Grammars(tokenizer, vocab_size, sorted(stop_token_ids))
    return _grammars


def grammars() -> Grammars:
    """The compiler installed by :func:`configure`; :class:`GrammarError` if there is none."""
    if _grammars is None:
        raise GrammarError(
            "grammar-constrained decoding is not configured in this worker (worker.grammar.configure was not called)"
        )
    return _grammars


class RowGrammar:
    """One row's matcher. ``fill(bitmask, row)`` writes the allowed tokens; ``accept(token_id)``
    advances. Created around a compile future; the matcher is made on first use."""

    def __init__(self, compiled: Future, vocab_size: int):
        self._compiled = compiled
        self.vocab_size = vocab_size
        self._matcher = None
        self._pending: list[int] = []  # tokens accepted before the compile finished (resume replay)
        self.failed: str | None = None

    def _ready(self):
        if self._matcher is None and self.failed is None:
            import xgrammar as xgr

            try:
                self._matcher = xgr.GrammarMatcher(self._compiled.result())
            except Exception as exc:  # noqa: BLE001 (xgrammar raises RuntimeError and others)
                self.failed = f"grammar could not be compiled: {str(exc)[:300]}"
                return None
            for t in self._pending:
                self._accept_now(t)
            self._pending.clear()
        return self._matcher

    @property
    def terminated(self) -> bool:
        m = self._ready()
        return bool(m is not None and m.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write row ``row`` of ``bitmask`` (int32 [B, ceil(V/32)]). False when the row cannot go on."""
        m = self._ready()
        if m is None or m.is_terminated():
            return False
        m.fill_next_token_bitmask(bitmask, row)
        return True

    def accept(self, token_id: int) -> None:
        if self._matcher is None and self.failed is None and not self._compiled.done():
            self._pending.append(token_id)
            return
        self._accept_now(token_id)

    def _accept_now(self, token_id: int) -> None:
        m = self._ready()
        if m is None or m.is_terminated():
            return
        if not m.accept_token(token_id):
            self.failed = f"token {token_id} is not allowed by the grammar"
