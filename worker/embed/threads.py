"""How many torch threads an embedding forward pass uses on CPU, measured on the machine at start.

A one-sentence batch (tens of tokens) is a handful of small matrix products: whether splitting
them over cores pays depends on the machine and on what else runs there. On a quiet CPU two
threads read the weights faster; on a box whose cores are busy elsewhere a 2-thread pass waits at
every barrier for a descheduled thread, and can take many times one thread's time (measured in the
docs' benchmark results). So nothing here assumes either: at start, :func:`measure` times a few
padded batches (:data:`PROBES`) on one thread and on all the worker's cores — interleaved, the
best of :data:`REPEATS` (other processes only ever add time, so the best is the steadiest figure)
— within :data:`BUDGET_S` seconds, and a batch runs on all cores only where that was at least
:data:`MIN_GAIN` faster. The timer is injectable, so the choice is unit-tested with a fake clock.

At run time a batch of T padded tokens (inputs x longest) takes the pick of the smallest probe of
at least T tokens; beyond the last probe, the last pick when it was all cores, else the fixed rule
(all cores from :data:`PARALLEL_TOKENS`, where the work per barrier is large). A probe not measured
(the budget ran out; a single core) follows the fixed rule too. A size picked for all cores is
checked against the batches served and goes back to one thread while they are slower
(:mod:`worker.embed.thread_watch`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from worker.embed.thread_watch import Watch

PARALLEL_TOKENS = 512  # padded tokens from which a batch runs on all cores when nothing says otherwise
PROBES = ((1, 8), (1, 32), (4, 32))  # (inputs, padded length) timed at start: 8, 32 and 128 padded tokens
WARMUP = 1  # untimed calls per probe and thread count: the thread pool starts, caches warm
REPEATS = 3  # timed calls per probe and thread count; the best is the figure
# all cores must be at least this much faster than one thread to be picked: measured on an idle
# worker, while serving the router and the clients take part of the cores, and a thread they
# deschedule holds up every barrier of the pass
MIN_GAIN = 0.25
BUDGET_S = 0.6  # start-up time the measurement may take (a probe is skipped once it is spent)


@dataclass(frozen=True)
class ThreadPick:
    """Batches of up to ``tokens`` padded tokens run on ``threads`` threads; ``single_ms`` and
    ``parallel_ms``: the best time measured for the probe on one thread and on all cores."""

    tokens: int
    threads: int
    single_ms: float
    parallel_ms: float


def measure(
    run: Callable[[int, int, int], None],
    cores: int,
    budget_s: float = BUDGET_S,
    clock: Callable[[], float] = time.perf_counter,
) -> list[ThreadPick]:
    """Time ``run(inputs, width, threads)`` (one forward pass of ``inputs`` x ``width`` tokens on
    ``threads`` threads) for each of :data:`PROBES` on 1 and ``cores`` threads, smallest first,
    until ``budget_s`` seconds are spent: one :class:`ThreadPick` per probe timed on both (none on
    a single core). A probe the budget cut after one timed call on each still counts."""
    if cores <= 1:
        return []
    deadline = clock() + budget_s
    picks = []
    for inputs, width in PROBES:
        best = _best_times(run, inputs, width, cores, deadline, clock)
        if best is None:
            break
        single, parallel = best
        threads = cores if parallel <= single * (1 - MIN_GAIN) else 1
        picks.append(ThreadPick(inputs * width, threads, single * 1000, parallel * 1000))
    return picks


def _best_times(run, inputs: int, width: int, cores: int, deadline: float, clock) -> tuple[float, float] | None:
    """The best time of one probe on 1 and on ``cores`` threads (calls interleaved, the first
    :data:`WARMUP` untimed); None when the deadline came before both were timed."""
    best = {1: float("inf"), cores: float("inf")}
    for call in range(WARMUP + REPEATS):
        for threads in best:
            if clock() > deadline:
                return None if float("inf") in best.values() else (best[1], best[cores])
            began = clock()
            run(inputs, width, threads)
            if call >= WARMUP:
                best[threads] = min(best[threads], clock() - began)
    return best[1], best[cores]


class ThreadPlan:
    """Sets torch's intra-op threads per batch (module docstring): ``cores`` is the thread count the
    worker was given (its pinned cores, or torch's default); ``picks`` what :func:`measure` found."""

    def __init__(self, cores: int | None = None, picks: list[ThreadPick] | None = None):
        self.cores = max(1, cores if cores is not None else torch.get_num_threads())
        self.picks = sorted(picks or [], key=lambda p: p.tokens)
        # the sizes picked for all cores, checked against the batches served (worker.embed.thread_watch)
        self.watches = {p.tokens: Watch(p.tokens, p.single_ms / 1000, MIN_GAIN) for p in self.picks if p.threads > 1}

    def _pick(self, padded_tokens: int) -> ThreadPick | None:
        return next((p for p in self.picks if padded_tokens <= p.tokens), None)

    def threads_for(self, padded_tokens: int) -> int:
        """The thread count for a batch of ``padded_tokens`` (inputs x longest input)."""
        pick = self._pick(padded_tokens)
        if pick is not None:
            watch = self.watches.get(pick.tokens)
            return 1 if pick.threads == 1 or (watch is not None and not watch.parallel) else self.cores
        if self.picks and self.picks[-1].threads > 1:
            return self.cores
        return 1 if padded_tokens < PARALLEL_TOKENS else self.cores

    def apply(self, padded_tokens: int) -> int:
        """Set torch's thread count for this batch (only when it changes: the call is not free);
        returns it."""
        want = self.threads_for(padded_tokens)
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)
        return want

    def record(self, padded_tokens: int, threads: int, seconds: float) -> None:
        """A batch of ``padded_tokens`` ran on ``threads`` threads in ``seconds`` (its forward pass)."""
        pick = self._pick(padded_tokens)
        watch = self.watches.get(pick.tokens) if pick is not None else None
        if watch is not None:
            watch.record(threads > 1, seconds)

    def describe(self) -> str:
        """One line for the start-up log: the pick per probe with both times, and the rule beyond."""
        if self.cores == 1:
            return "1 core: every batch on 1 thread"
        measured = ", ".join(
            f"<= {p.tokens} tokens: {p.threads} (1 thread {p.single_ms:.1f} ms, {self.cores} threads "
            f"{p.parallel_ms:.1f} ms)"
            for p in self.picks
        )
        beyond = (
            f"beyond: {self.cores}"
            if self.picks and self.picks[-1].threads > 1
            else f"beyond: 1 below {PARALLEL_TOKENS} padded tokens, else {self.cores}"
        )
        return f"{measured}; {beyond}" if measured else f"not measured; {beyond}"
