"""Issue 6: admission control (worker/scheduler.py) as pure logic: FCFS, max_num_seqs, KV budget, queue bound."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.scheduler import QueueFull, Scheduler, TooLarge


@dataclass
class Req:
    request_id: str
    prompt_len: int
    max_new: int
    prompt: list[int] = field(init=False)

    def __post_init__(self):
        self.prompt = [1] * self.prompt_len

    @property
    def worst_case_tokens(self) -> int:
        return self.prompt_len + self.max_new


def ids(seqs) -> list[str]:
    return [s.request_id for s in seqs]


def test_admits_in_arrival_order_up_to_max_num_seqs():
    s = Scheduler(max_num_seqs=2, max_waiting=10, kv_budget_tokens=10_000)
    for i in range(4):
        s.add(Req(f"r{i}", 10, 10))
    assert ids(s.admit()) == ["r0", "r1"]
    assert ids(s.running) == ["r0", "r1"] and ids(s.waiting) == ["r2", "r3"]
    assert s.admit() == []  # full
    assert s.retire({"r0"}) == [1]
    assert ids(s.admit()) == ["r2"]
    assert ids(s.running) == ["r1", "r2"] and s.peak_running == 2


def test_kv_budget_counts_the_padded_worst_case():
    # rows × longest worst case: 3 rows of worst case 40 need 120 tokens
    s = Scheduler(max_num_seqs=8, max_waiting=10, kv_budget_tokens=100)
    for i in range(3):
        s.add(Req(f"r{i}", 20, 20))
    assert ids(s.admit()) == ["r0", "r1"]
    assert s.reserved_tokens == 80
    s.retire({"r0"})
    assert ids(s.admit()) == ["r2"]
    assert s.reserved_tokens <= s.kv_budget_tokens


def test_fcfs_nobody_overtakes_a_head_that_does_not_fit():
    s = Scheduler(max_num_seqs=8, max_waiting=10, kv_budget_tokens=100)
    s.add(Req("big", 30, 30))    # 60
    s.add(Req("huge", 50, 40))   # 90: with "big" running, 2 × 90 > 100
    s.add(Req("small", 2, 2))    # would fit, but must not overtake "huge"
    assert ids(s.admit()) == ["big"]
    assert s.admit() == []
    s.retire({"big"})
    assert ids(s.admit()) == ["huge"]
    assert s.admit() == []
    s.retire({"huge"})
    assert ids(s.admit()) == ["small"]


def test_request_larger_than_the_whole_budget_is_refused():
    s = Scheduler(max_num_seqs=8, max_waiting=10, kv_budget_tokens=100)
    with pytest.raises(TooLarge):
        s.add(Req("r", 90, 20))
    assert not s.waiting


def test_worker_capacity_is_running_plus_waiting():
    """The worker holds max_num_seqs + max_waiting requests, as the router counts them."""
    s = Scheduler(max_num_seqs=2, max_waiting=2, kv_budget_tokens=1000)
    for rid in "abcd":
        s.add(Req(rid, 1, 1))
    with pytest.raises(QueueFull):
        s.add(Req("e", 1, 1))
    s.admit()
    with pytest.raises(QueueFull):  # two running, two waiting: still full
        s.add(Req("e", 1, 1))
    s.retire({"a"})
    s.add(Req("e", 1, 1))  # room again once one finished
    assert ids(s.waiting) == ["c", "d", "e"]


def test_kv_bound_batch_may_queue_into_its_empty_slots():
    """When the KV budget keeps batch slots empty, those requests wait instead of being refused."""
    s = Scheduler(max_num_seqs=4, max_waiting=1, kv_budget_tokens=100)
    for i in range(5):
        s.add(Req(f"r{i}", 25, 25))  # 50 each: only 2 fit
    assert ids(s.admit()) == ["r0", "r1"]
    assert len(s.waiting) == 3
    with pytest.raises(QueueFull):
        s.add(Req("r5", 25, 25))


def test_zero_waiting_capacity_is_the_batch():
    s = Scheduler(max_num_seqs=1, max_waiting=0, kv_budget_tokens=1000)
    s.add(Req("a", 1, 1))
    with pytest.raises(QueueFull):
        s.add(Req("b", 1, 1))


def test_prefill_token_cap_splits_newcomers_but_admits_at_least_one():
    s = Scheduler(max_num_seqs=8, max_waiting=10, kv_budget_tokens=10_000, max_prefill_tokens=100)
    s.add(Req("long", 300, 10))  # alone over the cap: admitted anyway
    s.add(Req("a", 60, 10))
    s.add(Req("b", 60, 10))
    assert ids(s.admit()) == ["long"]
    assert ids(s.admit()) == ["a"]
    assert ids(s.admit()) == ["b"]


def test_prefill_request_cap():
    s = Scheduler(max_num_seqs=8, max_waiting=10, kv_budget_tokens=10_000, max_prefill_seqs=1)
    for i in range(3):
        s.add(Req(f"r{i}", 5, 5))
    assert [ids(s.admit()) for _ in range(4)] == [["r0"], ["r1"], ["r2"], []]
    both = Scheduler(max_num_seqs=8, max_waiting=10, kv_budget_tokens=10_000, max_prefill_seqs=2)
    for i in range(3):
        both.add(Req(f"r{i}", 5, 5))
    assert ids(both.admit()) == ["r0", "r1"]


def test_drop_waiting_and_retire_keep_order():
    s = Scheduler(max_num_seqs=4, max_waiting=10, kv_budget_tokens=10_000)
    for i in range(6):
        s.add(Req(f"r{i}", 5, 5))
    s.admit()
    assert s.drop_waiting("r5").request_id == "r5"
    assert s.drop_waiting("r0") is None  # running, not waiting
    assert s.retire({"r1", "r3"}) == [0, 2]
    assert ids(s.running) == ["r0", "r2"]
    assert ids(s.admit()) == ["r4"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 60), st.integers(1, 60), st.booleans()), min_size=1, max_size=60),
       st.integers(1, 6), st.integers(120, 400))
def test_invariants_under_random_load(reqs, max_seqs, budget):
    """Whatever arrives and finishes: never over the caps, FCFS order of admission, nothing lost."""
    s = Scheduler(max_num_seqs=max_seqs, max_waiting=1000, kv_budget_tokens=budget)
    accepted, admitted, done = [], [], set()
    for i, (p, n, finish_one) in enumerate(reqs):
        try:
            s.add(Req(f"r{i}", p, n))
            accepted.append(f"r{i}")
        except TooLarge:
            assert p + n > budget
        admitted += ids(s.admit())
        assert len(s.running) <= max_seqs
        assert s.reserved_tokens <= budget
        if finish_one and s.running:
            done.add(s.running[0].request_id)
            s.retire({s.running[0].request_id})
    while s.running or s.waiting:
        new = s.admit()
        admitted += ids(new)
        assert s.running, "a waiting request must be admissible once nothing runs"
        done |= set(ids(s.running))
        s.retire(set(ids(s.running)))
    assert admitted == accepted  # first come, first served
    assert done == set(accepted)
