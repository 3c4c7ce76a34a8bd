"""The scheduler: chunked prefill under a token budget, admission by need, preemption of the newest,
queue limits and deadlines. Pure logic over fake sequences and a real BlockManager."""

from __future__ import annotations

import pytest

from worker.blocks import BlockManager, BlockTable
from worker.scheduler import QueueFull, Scheduler, TooLarge


class Seq:
    def __init__(self, rid: str, prompt_len: int, max_output: int = 8, base: int = 0):
        self.request_id = rid
        self.prompt = [base + i for i in range(prompt_len)]
        self.output: list[int] = []
        self.max_output = max_output
        self.table = BlockTable()
        self.computed = 0
        self.cached_at_admission = 0
        self.preemptions = 0

    @property
    def token_ids(self):
        return self.prompt + self.output

    @property
    def num_tokens(self):
        return len(self.prompt) + len(self.output)

    @property
    def max_tokens(self):
        return len(self.prompt) + self.max_output


def run_step(s: Scheduler):
    """Plan, pretend to compute, and 'sample' token 7 for every ready sequence."""
    plan = s.schedule()
    for seq in s.finish_step(plan):
        seq.output.append(7)
    return plan


def make(blocks=64, bs=4, seqs=8, waiting=16, prefill=8, idle=None, **kw) -> Scheduler:
    return Scheduler(BlockManager(blocks, bs), seqs, waiting, prefill, idle_prefill_tokens=idle, **kw)


def test_long_prompt_is_chunked_while_others_decode():
    s = make(prefill=8)
    chat = Seq("chat", 6)
    s.add(chat)
    run_step(s)  # chat prefilled whole (idle budget = 8 too)
    doc = Seq("doc", 30, base=1000)
    s.add(doc)
    chunks = []
    while doc.computed < len(doc.prompt):
        plan = run_step(s)
        assert chat in plan.decode  # the chat decodes every step meanwhile
        chunks += [e - b for q, b, e in plan.prefill if q is doc]
    assert chunks == [8, 8, 8, 6] and max(chunks) <= 8


def test_burst_of_newcomers_share_one_budget():
    s = make(prefill=16, idle=16)
    for i in range(4):
        s.add(Seq(f"r{i}", 4, base=100 * i))
    plan = s.schedule()
    assert [(q.request_id, b, e) for q, b, e in plan.prefill] == [
        ("r0", 0, 4),
        ("r1", 0, 4),
        ("r2", 0, 4),
        ("r3", 0, 4),
    ]


def test_idle_budget_applies_only_when_nothing_decodes():
    s = make(prefill=4, idle=32)
    s.add(Seq("a", 20))
    plan = s.schedule()
    assert sum(e - b for _, b, e in plan.prefill) == 20


def test_admission_by_need_not_padded_worst_case():
    # 20 blocks of 4 = 80 tokens: a padded batch of five rows of 48 would need 240; by need
    # (10 + 4 blocks, one spare per running sequence) all five run.
    s = make(blocks=20, bs=4, prefill=64, idle=64)
    s.add(Seq("doc", 40, max_output=8))
    for i in range(4):
        s.add(Seq(f"c{i}", 3, max_output=8, base=100 * (i + 1)))
    run_step(s)
    assert len(s.running) == 5


def test_preempts_newest_when_blocks_run_out_and_recomputes():
    s = make(blocks=4, bs=4, prefill=16, idle=16)  # 16 token slots
    a, b = Seq("a", 7, max_output=9), Seq("b", 3, max_output=9, base=50)
    s.add(a)
    s.add(b)
    preempted = []
    for _ in range(40):
        if not s.running and not s.waiting:
            break
        plan = run_step(s)
        preempted += [q.request_id for q in plan.preempted]
        assert sum(len(q.table.blocks) for q in s.running) <= 4  # never past the cache
        for q in list(s.running):
            if len(q.output) >= q.max_output:
                s.retire({q.request_id})
    assert preempted and preempted[0] == "b"  # the newest goes first
    assert len(a.output) == 9 and len(b.output) == 9  # nobody lost
    assert b.preemptions >= 1


def test_too_large_names_both_numbers_and_queue_full():
    s = make(blocks=4, bs=4, seqs=1, waiting=1)
    with pytest.raises(TooLarge, match=r"needs 20 KV tokens .* holds 16 tokens"):
        s.add(Seq("big", 12, max_output=8))
    s.add(Seq("a", 2))
    s.add(Seq("b", 2))
    with pytest.raises(QueueFull):
        s.add(Seq("c", 2))


def test_head_of_queue_is_never_overtaken():
    s = make(blocks=6, bs=4, prefill=64, idle=64)
    s.add(Seq("a", 12, max_output=4))  # 3 blocks
    run_step(s)
    s.add(Seq("big", 14, max_output=2, base=100))  # 4 blocks: does not fit beside a (+1 reserve)
    s.add(Seq("small", 2, base=200))  # would fit, but must wait behind big
    run_step(s)
    assert [q.request_id for q in s.running] == ["a"]


def test_queue_deadline_expires_waiting_requests():
    now = [0.0]
    s = make(blocks=4, bs=4, seqs=1, max_queue_wait_s=5.0, clock=lambda: now[0])
    s.add(Seq("a", 6, max_output=2))
    run_step(s)
    s.add(Seq("late", 2, base=9))
    now[0] = 6.0
    plan = s.schedule()
    assert [q.request_id for q in plan.expired] == ["late"] and not s.waiting


def test_cancelled_waiting_is_dropped():
    s = make()
    s.add(Seq("a", 2))
    assert s.drop_waiting("a").request_id == "a" and not s.waiting
    assert s.drop_waiting("nope") is None
