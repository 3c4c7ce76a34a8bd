"""The embedding batcher as pure logic (worker/embed/batcher.py): the token budget per step,
round-robin fairness across requests, no starvation, micro-batches, backpressure and expiry."""

from __future__ import annotations

import pytest

from worker.embed.batcher import Batcher, EmbedJob, QueueFull, micro_batches


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def job(rid: str, *lengths: int) -> EmbedJob:
    return EmbedJob(rid, [[1] * n for n in lengths])


def finish(batcher: Batcher, items) -> None:
    """What the engine does with a computed step: mark each input done, drop complete requests."""
    for item in items:
        item.job.done += 1
        if item.job.complete:
            batcher.drop(item.job.request_id)


def run(batcher: Batcher) -> list[list[tuple[str, int]]]:
    """Steps until the queue is empty: each step's (request, input index) in the order taken."""
    steps = []
    while batcher.jobs:
        step = batcher.take()
        steps.append([(i.job.request_id, i.index) for i in step.items])
        finish(batcher, step.items)
        assert len(steps) < 10_000
    return steps


def test_a_step_stays_within_the_token_budget_and_takes_at_least_one_input():
    b = Batcher(token_budget=100, max_requests=10)
    b.add(job("a", *[30] * 10))
    step = b.take()
    assert [i.index for i in step.items] == [0, 1, 2]  # 90 tokens; a fourth would make 120
    big = Batcher(token_budget=10, max_requests=10)
    big.add(job("b", 50))
    assert len(big.take().items) == 1  # over the budget alone: still taken, on its own


def test_round_robin_across_requests_in_arrival_order():
    b = Batcher(token_budget=1000, max_requests=10)
    b.add(job("big", *[5] * 6))
    b.add(job("s1", 5))
    b.add(job("s2", 5, 5))
    steps = run(b)
    assert steps[0][:5] == [("big", 0), ("s1", 0), ("s2", 0), ("big", 1), ("s2", 1)]
    assert len(steps) == 1


def test_one_line_requests_finish_in_the_first_step_beside_a_2048_input_request():
    b = Batcher(token_budget=4096, max_requests=200)
    b.add(job("huge", *[10] * 2048))
    for i in range(100):
        b.add(job(f"line{i}", 12))
    first = b.take()
    taken = {i.job.request_id for i in first.items}
    assert {f"line{i}" for i in range(100)} <= taken  # every small request within its first step
    assert sum(len(i.ids) for i in first.items) <= 4096
    finish(b, first.items)
    assert list(b.jobs) == ["huge"]
    steps = run(b)
    assert all(steps) and sum(map(len, steps)) + sum(i.job.request_id == "huge" for i in first.items) == 2048


def test_a_large_request_advances_every_step_under_a_stream_of_small_ones():
    b = Batcher(token_budget=50, max_requests=1000)
    b.add(job("large", *[10] * 20))
    progress = []
    for n in range(40):
        for i in range(3):  # three new one-line requests arrive before each step
            b.add(job(f"r{n}.{i}", 10))
        step = b.take()
        progress.append(sum(i.job.request_id == "large" for i in step.items))
        finish(b, step.items)
        if "large" not in b.jobs:
            break
    assert "large" not in b.jobs and all(p >= 1 for p in progress)  # never starved


def test_small_requests_are_not_starved_by_a_large_one_queued_first():
    b = Batcher(token_budget=40, max_requests=10)
    b.add(job("large", *[10] * 100))
    b.add(job("small", 10))
    first = b.take()
    assert ("small", 0) in [(i.job.request_id, i.index) for i in first.items]


def test_micro_batches_sorted_by_length_within_the_padded_budget():
    b = Batcher(token_budget=1000, max_requests=10)
    b.add(job("a", 3, 40, 7, 40, 2))
    items = b.take().items
    batches = micro_batches(items, 64)
    assert [[len(i.ids) for i in batch] for batch in batches] == [[2, 3, 7], [40], [40]]
    assert all(len(batch) * max(len(i.ids) for i in batch) <= 64 for batch in batches)
    assert sorted(id(i) for batch in batches for i in batch) == sorted(id(i) for i in items)


def test_the_queue_is_bounded():
    b = Batcher(token_budget=100, max_requests=2)
    b.add(job("a", 1))
    b.add(job("b", 1))
    with pytest.raises(QueueFull):
        b.add(job("c", 1))
    b.drop("a")
    b.add(job("c", 1))


def test_a_request_not_started_within_the_queue_wait_expires():
    clock = Clock()
    b = Batcher(token_budget=10, max_requests=10, max_queue_wait_s=5.0, clock=clock)
    b.add(job("first", *[10] * 10))
    b.add(job("second", 10))
    b.take()  # one input of "first": the budget is spent
    assert b.running == 1 and b.waiting == 1
    clock.now = 6.0
    step = b.take()
    assert [j.request_id for j in step.expired] == ["second"] and "second" not in b.jobs
    assert "first" in b.jobs  # started: it is not expired, it finishes


def test_a_dropped_request_is_never_taken_again():
    b = Batcher(token_budget=10, max_requests=10)
    b.add(job("a", *[10] * 5))
    b.take()
    b.drop("a")
    assert b.take().items == [] and not b.jobs
