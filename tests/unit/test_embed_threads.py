"""The embedding forward pass's thread count: measured at start per batch size (with a fake clock
here), the fixed rule where nothing was measured."""

from __future__ import annotations

import pytest
import torch

from worker.embed.thread_watch import RETRY_EVERY
from worker.embed.threads import MIN_GAIN, PARALLEL_TOKENS, PROBES, REPEATS, WARMUP, ThreadPick, ThreadPlan, measure


class FakeMachine:
    """A clock and a forward pass whose time is ``cost(tokens, threads)`` seconds; records the calls."""

    def __init__(self, cost):
        self.now = 0.0
        self.cost = cost
        self.calls: list[tuple[int, int, int]] = []

    def clock(self) -> float:
        return self.now

    def run(self, inputs: int, width: int, threads: int) -> None:
        self.calls.append((inputs, width, threads))
        self.now += self.cost(inputs * width, threads)


def quiet(tokens: int, threads: int) -> float:
    """Two threads pay off from 32 tokens: below, the hand-off costs more than the split saves."""
    return tokens * 1e-4 / (1.8 if threads > 1 and tokens >= 32 else 1) + (2e-4 if threads > 1 else 0)


def test_all_cores_are_picked_only_where_they_were_measured_faster():
    machine = FakeMachine(quiet)
    picks = measure(machine.run, cores=2, budget_s=10, clock=machine.clock)
    assert [(p.tokens, p.threads) for p in picks] == [(8, 1), (32, 2), (128, 2)]
    assert picks[1].single_ms == pytest.approx(3.2) and picks[1].parallel_ms == pytest.approx(32e-4 / 1.8 * 1e3 + 0.2)
    # every probe on both thread counts, interleaved, warm-up calls included
    assert len(machine.calls) == len(PROBES) * (WARMUP + REPEATS) * 2
    assert machine.calls[:2] == [(1, 8, 1), (1, 8, 2)]
    plan = ThreadPlan(2, picks)
    assert [plan.threads_for(t) for t in (1, 8, 9, 12, 32, 112, 128, 129, 4096)] == [1, 1, 2, 2, 2, 2, 2, 2, 2]
    assert "<= 32 tokens: 2 (1 thread 3.2 ms" in plan.describe()


def test_a_busy_machine_keeps_small_batches_on_one_thread_and_large_ones_on_the_fixed_rule():
    machine = FakeMachine(lambda tokens, threads: tokens * 1e-4 * (15 if threads > 1 else 1))
    plan = ThreadPlan(2, measure(machine.run, cores=2, budget_s=10, clock=machine.clock))
    assert [p.threads for p in plan.picks] == [1, 1, 1]
    assert [plan.threads_for(t) for t in (12, 128, PARALLEL_TOKENS - 1, PARALLEL_TOKENS)] == [1, 1, 1, 2]


def test_a_gain_under_the_margin_is_not_enough():
    gain = MIN_GAIN / 2
    machine = FakeMachine(lambda tokens, threads: tokens * 1e-4 * ((1 - gain) if threads > 1 else 1))
    assert [p.threads for p in measure(machine.run, cores=4, budget_s=10, clock=machine.clock)] == [1, 1, 1]


def test_the_measurement_stops_when_its_budget_is_spent_and_the_rest_follows_the_fixed_rule():
    machine = FakeMachine(quiet)
    picks = measure(machine.run, cores=2, budget_s=0.01, clock=machine.clock)  # room for the first probe only
    assert [p.tokens for p in picks] == [8]
    assert all(width == 8 for _, width, _ in machine.calls[:-1])
    plan = ThreadPlan(2, picks)
    assert [plan.threads_for(t) for t in (8, 32, PARALLEL_TOKENS)] == [1, 1, 2]
    assert ThreadPlan(2).describe().startswith("not measured")


def test_a_probe_cut_by_the_budget_counts_once_both_thread_counts_were_timed():
    machine = FakeMachine(quiet)  # probe 8: 0.8 ms on 1 thread, 1.0 ms on 2
    picks = measure(machine.run, cores=2, budget_s=0.003, clock=machine.clock)  # warm-up and one timed call each
    assert len(machine.calls) == 2 * (WARMUP + 1)
    assert [(p.tokens, p.threads) for p in picks] == [(8, 1)]
    assert picks[0].single_ms == pytest.approx(0.8) and picks[0].parallel_ms == pytest.approx(1.0)
    machine = FakeMachine(quiet)
    assert measure(machine.run, cores=2, budget_s=0.0015, clock=machine.clock) == []  # warm-up only


def test_one_core_measures_nothing():
    machine = FakeMachine(quiet)
    assert measure(machine.run, cores=1, clock=machine.clock) == []
    assert machine.calls == []
    assert ThreadPlan(1).threads_for(10_000) == 1


def test_the_cores_default_to_torchs_thread_count_and_apply_sets_it():
    before = torch.get_num_threads()
    try:
        plan = ThreadPlan()
        assert plan.cores == before
        plan.apply(1)
        assert torch.get_num_threads() == 1
        plan.apply(PARALLEL_TOKENS)
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)


def test_a_size_picked_for_all_cores_goes_back_to_one_thread_while_served_batches_are_slower():
    plan = ThreadPlan(2, [ThreadPick(32, 2, single_ms=4.0, parallel_ms=2.0)])
    assert plan.threads_for(12) == 2
    for _ in range(50):
        plan.record(12, 2, 0.0025)  # as fast as measured: stays
    assert plan.threads_for(12) == 2
    for _ in range(30):  # the cores got busy: 3x slower than one thread was
        if plan.threads_for(12) == 1:
            break
        plan.record(12, 2, 0.012)
    assert plan.threads_for(12) == 1
    plan.record(12, 1, 0.004)  # batches on one thread count towards the next try
    for _ in range(RETRY_EVERY - 2):
        plan.record(12, 1, 0.004)
    assert plan.threads_for(12) == 1
    plan.record(12, 1, 0.004)
    assert plan.threads_for(12) == 2  # a retry is due
    plan.record(12, 2, 0.0039)  # not MIN_GAIN faster than one thread: stays on one
    assert plan.threads_for(12) == 1
    for _ in range(RETRY_EVERY):
        plan.record(12, 1, 0.004)
    plan.record(12, 2, 0.002)  # the cores are free again
    assert plan.threads_for(12) == 2


def test_only_sizes_picked_for_all_cores_are_watched():
    plan = ThreadPlan(2, [ThreadPick(8, 1, 1.0, 2.0), ThreadPick(32, 2, 4.0, 2.0)])
    assert list(plan.watches) == [32]
    plan.record(8, 1, 1.0)  # a one-thread size, and sizes beyond the probes, are left alone
    plan.record(4096, 2, 10.0)
    assert plan.threads_for(8) == 1 and plan.threads_for(4096) == 2
