"""The start-up heap of a serving process, out of the garbage collector's way (vLLM's
``freeze_gc_heap``).

A worker holds some 400,000 objects the collector tracks once its model, tokenizer and kernels are
loaded, the router some 340,000 (aiohttp, pydantic, the tokenizer); they live as long as the
process. CPython's full collection walks every one of them: about 0.2 s of CPU on the Zen 4 box,
during which the worker's engine loop takes no step and the router's event loop relays no token, so
every running stream pauses (more than a second of wall time on a busy machine). After
:func:`freeze_startup_heap` they sit in the permanent generation, which collections skip; objects
made while serving are collected as before. Stdlib only: the router and the worker both call it.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect now (garbage frozen would never be freed), then freeze every object still tracked;
    call once, when start-up is done and before serving. Returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%d start-up objects frozen out of the garbage collector's full collections", frozen)
    return frozen
