"""Sizing a prefill chunk beside decodes by measured step costs (:mod:`worker.step_cost`), the
scheduler spending that budget, and the calibration's design, all with fake timings: the costs a
machine would show are made up here and must come back out of the fit, and every step the scheduler
plans must stay within the bound those costs imply."""

from __future__ import annotations

import dataclasses

import pytest

from tests.unit.test_scheduler import Seq, run_step
from worker.blocks import BlockManager
from worker.scheduler import Scheduler
from worker.step_cost import StepCost, keys

# A Zen-4-like machine at the default precision: a 4-row decode step of ~24 ms, a chunk step with a
# fixed 8 ms of eager overhead, 2.5 ms per prompt token and an attention that doubles a token's cost
# at ~1,000 keys.
TRUE = StepCost(decode_s=0.020, decode_row_s=0.001, chunk_s=0.008, token_s=0.0025, key_s=2.5e-6, ratio=2.0)


def step_s(cost: StepCost, rows: int, chunks: list[tuple[int, int]]) -> float:
    """What a step of ``rows`` decodes and ``chunks`` ((start, tokens) each) takes on the machine ``cost``."""
    extra = sum(cost.token_s * n + cost.key_s * keys(s, n) for s, n in chunks)
    return cost.decode_step_s(rows) + (cost.chunk_s if chunks else 0.0) + extra


def timings(cost: StepCost, rows: int = 4, sizes=(16, 64), starts=(0, 1024)):
    decode = {r: step_s(cost, r, []) for r in (1, rows)}
    chunks = {(n, s): step_s(cost, rows, [(s, n)]) for n in sizes for s in starts}
    return decode, chunks


def test_keys_counts_each_position_over_every_key_before_it_and_itself():
    assert keys(0, 1) == 1 and keys(0, 3) == 1 + 2 + 3
    assert keys(100, 2) == 101 + 102


def test_fit_recovers_the_costs_from_exact_timings():
    decode, chunks = timings(TRUE)
    got = StepCost.fit(decode, 4, chunks, 2.0)
    for name in ("decode_s", "decode_row_s", "chunk_s", "token_s", "key_s"):
        assert getattr(got, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name


def test_fit_takes_noise_that_reads_as_negative_cost_as_zero():
    flat = StepCost(0.02, 0.0, 0.0, 0.002, 0.0, 2.0)
    decode, chunks = timings(flat)
    chunks[(16, 1024)] -= 0.001  # the far chunk happened to run faster: no negative attention cost
    decode[1] += 0.001  # the one-row step slower than four rows: no negative cost per row
    got = StepCost.fit(decode, 4, chunks, 2.0)
    assert got.key_s == 0.0 and got.decode_row_s == 0.0 and got.chunk_s >= 0.0 and got.token_s > 0


def test_fit_refuses_another_design_and_takes_one_row_count():
    decode, chunks = timings(TRUE)
    with pytest.raises(ValueError):
        StepCost.fit(decode, 4, {k: v for k, v in chunks.items() if k != (64, 0)}, 2.0)
    one = StepCost.fit({1: decode[1]}, 1, timings(TRUE, rows=1)[1], 2.0)
    assert one.decode_row_s == 0.0 and one.decode_s == pytest.approx(decode[1])


def test_tokens_within_is_the_longest_chunk_the_budget_pays_for_and_shrinks_with_the_position():
    for start in (0, 17, 300, 1500, 4000):
        for budget in (0.5, 1.0, 7.3, 40.0, 500.0):
            n = TRUE.tokens_within(start, budget)
            assert TRUE.weight(start, n) <= budget < TRUE.weight(start, n + 1)
    b = TRUE.budget(4)
    sizes = [TRUE.tokens_within(s, b) for s in (0, 512, 1024, 2048)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1] > 0
    assert TRUE.tokens_within(0, 0.0) == 0
    assert StepCost(0.02, 0, 0, 0.001, 0.0, 2.0).tokens_within(5000, 12.9) == 12  # no attention cost: tokens


def test_budget_is_what_the_ratio_leaves_and_never_negative():
    # ratio 2: a 24 ms step leaves 24 ms, less the chunk's fixed 8 ms: 16 ms of 2.5 ms tokens
    assert TRUE.budget(4) == pytest.approx(6.4)
    assert TRUE.budget(8) > TRUE.budget(4)  # a longer decode step leaves more
    assert StepCost(0.01, 0, 0.05, 0.001, 0, 2.0).budget(4) == 0.0


def sized(cost: StepCost, idle: int = 512) -> Scheduler:
    s = Scheduler(BlockManager(600, 16), 8, 16, 16, idle_prefill_tokens=idle)
    s.set_prefill_budget(16, idle, cost)
    return s


def document_beside_chats(s: Scheduler, doc_tokens: int = 1500, chats: int = 4):
    """Chats decoding, then a document prefilled beside them; the steps' (rows, chunks) until its
    first token."""
    for i in range(chats):
        s.add(Seq(f"chat{i}", 20, max_output=1000, base=10_000 * (i + 1)))
    run_step(s)  # the chats' prompts, nothing decoding yet: the idle budget
    doc = Seq("doc", doc_tokens, max_output=4, base=900_000)
    s.add(doc)
    steps = []
    while not doc.output:
        plan = run_step(s)
        steps.append((len(plan.decode), [(b, e - b) for q, b, e in plan.prefill]))
    return steps


def test_every_step_beside_decodes_stays_within_the_bound_and_the_document_advances_each_step():
    steps = document_beside_chats(sized(TRUE))
    # the document advances every step; its last token is computed as a decode row
    assert steps[-1] == (5, []) and all(rows == 4 and len(chunks) == 1 for rows, chunks in steps[:-1])
    steps = steps[:-1]
    assert sum(n for _, chunks in steps for _, n in chunks) == 1499
    ratios = [step_s(TRUE, rows, chunks) / TRUE.decode_step_s(rows) for rows, chunks in steps]
    firsts = [n for _, ((_, n),) in steps]
    # within the bound, save where the floor of one token a step applies (the budget pays for none)
    assert all(r <= TRUE.ratio + 1e-9 or n == 1 for r, n in zip(ratios, firsts, strict=True))
    assert firsts[0] > firsts[-1]  # its first chunks are the longest: their attention is cheapest


def test_a_token_budget_lets_a_documents_late_chunks_overrun_what_its_first_ones_keep():
    """Why the budget counts costs: a fixed 16 tokens a step, on the same machine."""
    s = Scheduler(BlockManager(600, 16), 8, 16, 16, idle_prefill_tokens=64)
    ratios = [step_s(TRUE, r, c) / TRUE.decode_step_s(r) for r, c in document_beside_chats(s)[:-1]]
    assert ratios[-1] > 1.25 * ratios[0] and max(ratios) > TRUE.ratio


def test_without_decodes_the_idle_budget_counts_tokens_and_a_long_prompt_gets_one_token_when_none_fits():
    s = sized(StepCost(0.01, 0.0, 0.05, 0.001, 0.0, 2.0), idle=64)  # the chunk's fixed part alone overruns
    doc = Seq("doc", 600, max_output=4)
    s.add(doc)
    assert [(b, e) for _, b, e in run_step(s).prefill] == [(0, 64)]  # nothing decodes: 64 tokens
    s.add(Seq("chat", 10, max_output=50, base=5000))
    run_step(s)  # the chat's prompt and the document's next chunk: nothing decodes yet
    plan = run_step(s)  # now the chat decodes: the budget pays for nothing, the document still advances
    assert len(plan.decode) == 1 and [e - b for q, b, e in plan.prefill if q is doc] == [1]


def test_an_out_of_memory_back_off_returns_to_token_budgets():
    s = Scheduler(BlockManager(400, 4), 8, 16, 16, idle_prefill_tokens=64)
    s.set_prefill_budget(16, 64, TRUE)
    for i in range(2):
        s.add(Seq(f"chat{i}", 10, max_output=100, base=1000 * (i + 1)))
    run_step(s)
    s.add(Seq("doc", 300, base=50_000))
    plan = run_step(s)
    assert s.back_off_after_oom(plan).prefill_tokens == 8 and s.cost is None


class FakeRunner:
    """Stands in for the model runner in the calibration: each step advances a fake clock by what it
    takes on the machine ``cost``, and the blocks each step's sequences hold are recorded."""

    def __init__(self, cost: StepCost, num_blocks: int = 1000, block_size: int = 16):
        self.cost, self.now, self.plans = cost, 0.0, []
        self.cache = type("Cache", (), {"num_blocks": num_blocks, "block_size": block_size})()

    def clock(self) -> float:
        return self.now

    def run(self, plan) -> None:
        self.plans.append(plan)
        self.now += step_s(self.cost, len(plan.decode), [(b, e - b) for _, b, e in plan.prefill])


def test_the_calibration_times_its_design_and_fits_the_machines_costs():
    from worker import replica

    runner = FakeRunner(TRUE)
    got = replica.calibrate_step_cost(runner, 512, 8192, 8, clock=runner.clock)
    for name in ("decode_s", "decode_row_s", "chunk_s", "token_s", "key_s"):
        assert getattr(got, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name
    assert got.ratio == replica.STEP_RATIO
    for plan in runner.plans:  # no two sequences of a step share a block, all within the cache
        held = [b for q in [*plan.decode, *(q for q, _, _ in plan.prefill)] for b in q.table.blocks]
        assert len(held) == len(set(held)) and max(held) < 1000
    assert replica.prefill_budgets(dataclasses.replace(got, ratio=2.0), 512) == (6, 64)  # 4 chunks, each at least 16
    assert replica.prefill_budgets(dataclasses.replace(got, ratio=5.0), 512) == (34, 136)
    assert replica.prefill_budgets(dataclasses.replace(got, ratio=50.0), 512) == (390, 512)  # at most 512 alone
    assert replica.prefill_budgets(None, 512) == (16, 64)


def test_the_calibration_gives_way_when_the_cache_cannot_hold_its_steps():
    from worker import replica

    runner = FakeRunner(TRUE, num_blocks=40)
    assert replica.calibrate_step_cost(runner, 512, 8192, 8, clock=runner.clock) is None and not runner.plans


def test_step_costs_are_measured_once_per_key_and_read_at_the_next_start(tmp_path, monkeypatch):
    """The first start with a key measures and keeps the costs; the next with the same key reads them
    without measuring; another key (another machine, model, setting) measures; an unreadable file
    is measured again and replaced; None (a cache too small to calibrate) is not kept."""
    from worker import start_cache

    monkeypatch.setenv("LLAMADEPLOY_TUNING_DIR", str(tmp_path))
    calls = []

    def measure(cost=TRUE):
        calls.append(cost)
        return cost

    key = {"machine": "m1", "model": "/models/a", "settings": [8, False, 2048, 512]}
    assert start_cache.cached_step_cost(key, measure) == TRUE and len(calls) == 1
    assert start_cache.cached_step_cost(dict(key), measure) == TRUE and len(calls) == 1  # read, not measured
    other = {**key, "machine": "m2"}
    slower = dataclasses.replace(TRUE, token_s=0.005)
    assert start_cache.cached_step_cost(other, lambda: measure(slower)) == slower and len(calls) == 2
    assert start_cache.cached_step_cost(key, measure) == TRUE and len(calls) == 2  # each key its own file
    (kept,) = [p for p in tmp_path.glob("*.json") if start_cache.digest(key) in p.name]
    kept.write_text("{not json")
    assert start_cache.cached_step_cost(key, measure) == TRUE and len(calls) == 3
    assert start_cache.cached_step_cost(key, measure) == TRUE and len(calls) == 3  # replaced by a good one
    small = {**key, "settings": [8, False, 2048, 512, 40]}
    assert start_cache.cached_step_cost(small, lambda: None) is None
    assert start_cache.cached_step_cost(small, lambda: measure(None)) is None and len(calls) == 4
