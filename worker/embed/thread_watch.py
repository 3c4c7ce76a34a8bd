"""The start-up choice of all cores for a batch size, checked against the batches actually served.

The measurement at start (:func:`worker.embed.threads.measure`) runs on an idle worker. While
serving, the router, the clients or other jobs may take part of the cores, and then a pass on all
cores waits at every barrier for a descheduled thread and can become slower than one thread. So for
each batch size picked for all cores, a :class:`Watch` keeps a moving average of the times of the
batches run that way; once it is over the probe's single-thread time (the probe is at least as large
as any batch it covers, so one thread would have been at least that fast), those batches go back to
one thread. Every :data:`RETRY_EVERY` such batches one runs on all cores again, and all cores are
taken back when it is :data:`~worker.embed.threads.MIN_GAIN` faster than one thread was at start.
Pure logic (the times are given), unit-tested directly.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

SMOOTHING = 0.1  # weight of each new batch in the moving average: one hiccup does not decide
RETRY_EVERY = 200  # batches on one thread between two tries of all cores


class Watch:
    """One batch size's all-cores choice: ``tokens`` (the probe's padded tokens), ``single_s`` (its
    single-thread time at start), ``gain`` (how much faster a retry must be to win back)."""

    def __init__(self, tokens: int, single_s: float, gain: float):
        self.tokens = tokens
        self.single_s = single_s
        self.gain = gain
        self.average_s: float | None = None
        self.fallen_back = False
        self.since = 0  # batches on one thread since the fallback or the last retry

    @property
    def parallel(self) -> bool:
        """Whether the next batch of this size runs on all cores (the choice, or a due retry)."""
        return not self.fallen_back or self.since >= RETRY_EVERY

    def record(self, parallel: bool, seconds: float) -> None:
        """A batch of this size took ``seconds`` on all cores (``parallel``) or on one thread."""
        if not parallel:
            self.since += self.fallen_back
            return
        if self.fallen_back:  # a retry
            self.since = 0
            if seconds <= self.single_s * (1 - self.gain):
                self.fallen_back, self.average_s = False, seconds
                log.info(
                    "batches of up to %d padded tokens run on all cores again (%.1f ms)", self.tokens, seconds * 1e3
                )
            return
        avg = seconds if self.average_s is None else self.average_s + SMOOTHING * (seconds - self.average_s)
        self.average_s = avg
        if avg > self.single_s:
            self.fallen_back, self.since = True, 0
            log.warning(
                "batches of up to %d padded tokens average %.1f ms on all cores, over the %.1f ms one thread took "
                "at start (the cores are busy elsewhere): back to one thread, trying again every %d batches",
                self.tokens,
                avg * 1e3,
                self.single_s * 1e3,
                RETRY_EVERY,
            )
