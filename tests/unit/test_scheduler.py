"""The scheduler: chunked prefill under a token budget, admission by need, preemption of the newest,
queue limits and deadlines. Pure logic over fake sequences and a real BlockManager."""

from __future__ import annotations

import pytest

from worker.blocks import BlockManager, BlockTable
from worker.scheduler import QueueFull, Scheduler, StepPlan, TooLarge


class Seq:
    def __init__(self, rid: str, prompt_len: int, max_output: int = 8, base: int = 0, priority=0, flex=False):
        self.request_id = rid
        self.priority, self.flex = priority, flex
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


# ---- short before long, priority, flex (vLLM's partial-prefill limits and priority policy) ----------

from worker.request import RequestStatus  # noqa: E402
from worker.scheduler import PrefillShares  # noqa: E402


def shares(threshold=16, max_long=1, share=0.25) -> PrefillShares:
    return PrefillShares(long_threshold=threshold, max_long=max_long, long_share=share)


def decoding(s: Scheduler, rid: str = "chat") -> Seq:
    """A short sequence already decoding, so each step uses the beside-decodes budget."""
    chat = Seq(rid, 4, max_output=100, base=9000)
    s.add(chat)
    run_step(s)
    return chat


def test_short_prompt_joins_a_long_partial_prefill_and_overtakes_a_long_waiting_one():
    s = make(blocks=200, bs=4, prefill=32, idle=32, shares=shares())
    decoding(s)
    doc1, doc2 = Seq("doc1", 200, base=1000), Seq("doc2", 200, base=2000)
    s.add(doc1)
    run_step(s)
    assert 0 < doc1.computed < 200  # doc1 is a partial prefill now
    s.add(doc2)  # long, queued first
    s.add(Seq("short", 10, base=3000))  # short, queued behind it
    plan = run_step(s)
    chunks = [(q.request_id, b, e) for q, b, e in plan.prefill]
    assert chunks[0] == ("short", 0, 10)  # whole, and first in the step
    assert [c[0] for c in chunks] == ["short", "doc1"]  # doc1 goes on beside it in the same step
    assert [q.request_id for q in s.waiting] == ["doc2"]  # one long prefill at a time: doc2 waits its turn
    assert doc2.status is RequestStatus.WAITING


def test_long_prefill_is_never_starved_by_a_stream_of_short_prompts():
    s = make(blocks=1000, bs=4, seqs=64, waiting=1000, prefill=32, idle=32, shares=shares(share=0.25))
    decoding(s)
    doc = Seq("doc", 100, base=1000)
    s.add(doc)
    later = Seq("later", 60, base=2000)
    s.add(later)
    steps = 0
    while not later.output:
        for i in range(3):  # 30 short tokens a step: alone they would take the whole budget
            s.add(Seq(f"s{steps}.{i}", 10, max_output=1, base=10_000 + 100 * (3 * steps + i)))
        before = doc.computed
        run_step(s)
        steps += 1
        if doc.computed < 100:
            assert doc.computed - before >= 8  # at least a quarter of the 32-token budget, every step
        for q in list(s.running):
            if q.request_id.startswith("s") and q.output:
                s.retire({q.request_id})
        assert steps < 40
    assert doc.output  # the first long one finished its prompt before the second started
    assert steps <= -(-100 // 8) + -(-60 // 8) + 2


def test_waiting_requests_are_admitted_by_priority_then_arrival_interactive_before_flex():
    s = make(blocks=100, bs=4, seqs=1, prefill=64, idle=64)
    s.add(Seq("first", 3, max_output=1))
    run_step(s)
    s.add(Seq("flex", 3, max_output=1, base=100, flex=True))
    s.add(Seq("p5", 3, max_output=1, base=200, priority=5))
    s.add(Seq("p0-a", 3, max_output=1, base=300))
    s.add(Seq("p-1", 3, max_output=1, base=400, priority=-1))
    s.add(Seq("p0-b", 3, max_output=1, base=500))
    assert [q.request_id for q in s.waiting] == ["p-1", "p0-a", "p0-b", "p5", "flex"]
    order = []
    for _ in range(20):
        run_step(s)
        for q in list(s.running):
            if q.output:
                order.append(q.request_id)
                s.retire({q.request_id})
    assert order == ["first", "p-1", "p0-a", "p0-b", "p5", "flex"]


def test_interactive_request_preempts_a_flex_one_which_resumes_with_its_tokens():
    s = make(blocks=8, bs=4, prefill=64, idle=64)  # 32 token slots
    batch = Seq("batch", 12, max_output=8, flex=True)
    s.add(batch)
    for _ in range(4):
        run_step(s)
    made = list(batch.output)
    assert made and batch.status is RequestStatus.RUNNING
    chat = Seq("chat", 16, max_output=4, base=500)  # 4 blocks + 1 spare per running: does not fit beside it
    s.add(chat)
    plan = run_step(s)
    assert plan.preempted == [batch] and batch.status is RequestStatus.PREEMPTED and batch.computed == 0
    assert chat.status is RequestStatus.RUNNING and batch.output == made  # its tokens are kept
    while len(chat.output) < 4:
        run_step(s)
    s.retire({"chat"})
    assert chat.status is RequestStatus.FINISHED_STOPPED
    while len(batch.output) < 8:
        run_step(s)
    assert batch.output[: len(made)] == made and batch.preemptions == 1


def test_flex_request_does_not_preempt_and_decode_growth_gives_way_flex_first():
    s = make(blocks=8, bs=4, prefill=64, idle=64)
    s.add(Seq("a", 12, max_output=8, flex=True))
    run_step(s)
    late = Seq("late", 16, max_output=4, base=500, flex=True)
    s.add(late)
    run_step(s)
    assert late.status is RequestStatus.WAITING and s.preemptions == 0  # flex waits for flex
    s2 = make(blocks=5, bs=4, prefill=64, idle=64)  # 20 slots: both admitted, both cannot grow
    old, new = Seq("old", 7, max_output=9, flex=True), Seq("new", 3, max_output=9, base=50)
    s2.add(old)
    s2.add(new)
    preempted = []
    for _ in range(10):
        preempted += [q.request_id for q in run_step(s2).preempted]
    assert preempted[0] == "old"  # the flex one gives way, though it is not the newest


def test_out_of_memory_back_off_halves_then_preempts_then_aborts_a_lone_one():
    s = make(blocks=100, bs=4, prefill=64, idle=256)
    a, b = Seq("a", 3, max_output=20), Seq("b", 3, max_output=20, base=50)
    s.add(a)
    s.add(b)
    plan = s.schedule()
    backed = s.back_off_after_oom(plan)
    assert backed.prefill_tokens == 32 == s.max_prefill_tokens and s.idle_prefill_tokens == 128
    s.finish_step(plan)
    backed = s.back_off_after_oom(StepPlan(decode=[a, b]))
    assert backed.preempted is b and b.status is RequestStatus.PREEMPTED
    backed = s.back_off_after_oom(StepPlan(decode=[a]))
    assert backed.aborted == [a] and a.status is RequestStatus.FINISHED_ABORTED and not s.running
    assert s.blocks.num_free == s.blocks.num_blocks


def test_status_is_an_enum_the_scheduler_keeps():
    s = make(blocks=100, bs=4)
    a = Seq("a", 3, max_output=2)
    s.add(a)
    assert a.status is RequestStatus.WAITING
    run_step(s)
    assert a.status is RequestStatus.RUNNING
    s.preempt(a)
    assert a.status is RequestStatus.PREEMPTED and a.status.waiting
    run_step(s)
    s.finish(a, RequestStatus.FINISHED_LENGTH)
    assert a.status.finished and not s.running and s.blocks.num_free == 100
    s.add(Seq("w", 3))
    assert s.drop_waiting("w").status is RequestStatus.FINISHED_ABORTED


def test_a_long_prompts_last_chunks_stay_long_so_a_new_short_prompt_goes_first():
    s = make(blocks=200, bs=4, prefill=32, idle=32, shares=shares())  # long: > 16 tokens; 8 kept for long
    decoding(s)
    doc = Seq("doc", 100, base=1000)
    s.add(doc)
    while doc.num_tokens - doc.computed > 14:  # into its last 16 tokens: what is left is below the threshold
        run_step(s)
    short = Seq("short", 12, base=3000)
    s.add(short)
    plan = run_step(s)
    chunks = [(q.request_id, b, e) for q, b, e in plan.prefill]
    assert chunks[0] == ("short", 0, 12)  # whole and first: the document's tail does not take its budget
    assert chunks[1] == ("doc", chunks[1][1], 100)  # and the document finishes its prompt beside it
    assert short.output


def test_interactive_request_takes_the_seat_of_a_flex_one_when_the_batch_is_full():
    s = make(blocks=200, bs=4, seqs=2, prefill=64, idle=64)  # memory to spare, two seats
    lines = [Seq("line0", 6, max_output=10, flex=True), Seq("line1", 6, max_output=10, base=100, flex=True)]
    for line in lines:
        s.add(line)
    for _ in range(3):
        run_step(s)
    made = [list(line.output) for line in lines]
    s.add(Seq("line2", 6, max_output=10, base=200, flex=True))
    run_step(s)
    assert s.preemptions == 0  # a flex one waits for a flex seat
    chat = Seq("chat", 5, max_output=3, base=500)
    s.add(chat)
    plan = run_step(s)
    assert plan.preempted == [lines[1]] and chat.status is RequestStatus.RUNNING  # the newest flex gives way
    assert [q.request_id for q in s.waiting] == ["line1", "line2"]  # it keeps its place among the flex
    while len(chat.output) < 3:
        run_step(s)
    s.retire({"chat"})
    while len(lines[1].output) < 10:
        run_step(s)
        s.retire({q.request_id for q in s.running if len(q.output) >= 10})
    assert lines[1].output[: len(made[1])] == made[1] and lines[1].preemptions == 1


def test_at_a_measured_costs_floor_short_and_long_prompts_each_take_a_token_a_step():
    # a cost model calibrated on a busy machine: nothing is left beside a decode (budget 0 -> floor 1)
    from worker.step_cost import StepCost

    cost = StepCost(decode_s=0.03, decode_row_s=0.02, chunk_s=0.3, token_s=0.001, key_s=0.0, ratio=3.0)
    assert cost.budget(1) == 0.0
    s = make(blocks=256, prefill=8, idle=8, cost=cost, shares=PrefillShares(long_threshold=16))
    chat = Seq("chat", 4)
    s.add(chat)
    run_step(s)  # idle: prefilled whole, then decodes
    doc, question = Seq("doc", 60, base=1000), Seq("question", 6, base=2000)
    s.add(doc)
    run_step(s)  # the document starts beside the decode
    s.add(question)
    plan = run_step(s)
    took = {q.request_id: e - b for q, b, e in plan.prefill}
    assert took.get("question", 0) >= 1 and took.get("doc", 0) >= 1, took
