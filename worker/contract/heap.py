"""The start-up heap of a serving process, out of the garbage collector's way (vLLM's
``freeze_gc_heap``).

A worker holds some 400,000 objects the collector tracks once its model, tokenizer and kernels are
loaded, the router some 340,000 (aiohttp, pydantic, the tokenizer); they live as long as the
process. CPython's full collection walks every one of them: about 0.2 s of CPU on the Zen 4 box,
during which the worker's engine loop takes no step and the router's event loop relays no token, so
every running stream pauses (more than a second of wall time on a busy machine). After
:func:`freeze_startup_heap` they sit in the permanent generation, which collections skip; objects
made while serving are collected as before. Stdlib only: the router and the worker both call it.

A collection of any generation that still takes longer than :data:`SLOW_COLLECTION_S` is logged
(a warning naming its generation and time), so a pause seen by a client can be told from the
engine's own steps.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)

SLOW_COLLECTION_S = 0.05  # a collection this long is a pause a streaming client can see


class CollectionWatch:
    """A ``gc.callbacks`` entry that logs every collection over ``slow_s`` seconds (``clock``:
    seconds)."""

    def __init__(self, slow_s: float = SLOW_COLLECTION_S, clock=time.perf_counter):
        self.slow_s, self.clock = slow_s, clock
        self._began = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = self.clock()
            return
        took = self.clock() - self._began
        if took > self.slow_s:
            log.warning(
                "garbage collection of generation %d took %.0f ms (%d objects freed): every stream of this process paused",
                info["generation"],
                1e3 * took,
                info["collected"],
            )


def freeze_startup_heap() -> int:
    """Collect now (garbage frozen would never be freed), then freeze every object still tracked;
    call when start-up is done and before serving, and again after start-up work that finishes
    later (the router's grammar compiler); from then on slow collections are logged
    (:class:`CollectionWatch`, added once). Returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    if not any(isinstance(cb, CollectionWatch) for cb in gc.callbacks):
        gc.callbacks.append(CollectionWatch())
    frozen = gc.get_freeze_count()
    log.info("%d start-up objects frozen out of the garbage collector's full collections", frozen)
    return frozen
