"""The engine in process, on the real embedded model in float32 on CPU (loaded once per session,
``tests/helpers/engine_run.py``).

What a sequence generates must not depend on how the engine got there: greedy output and seeded
sampling are the same alone, batched, with its prompt prefilled in chunks, with its prefix found in
the cache, after it was preempted and recomputed, and resumed from tokens an earlier attempt made.
Timing belongs to ``llamadeploy bench``; the stall and burst behaviour is asserted by event order.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.engine_run import BLOCK, QUESTIONS, Run, chat_ids
from worker.contract.protocol import Failed, Tokens
from worker.runner import ModelRunner
from worker.scheduler import PrefillShares
from worker.step_cost import StepCost


@pytest.fixture(scope="module")
def prompts(loaded) -> list[list[int]]:
    return [chat_ids(loaded[1], q) for q in QUESTIONS]


@pytest.fixture(scope="module")
def document(loaded) -> list[int]:
    text = " ".join(
        f"Section {i}: the committee reviewed item {i * 7} and approved budget line {i * 13}." for i in range(12)
    )
    return chat_ids(loaded[1], "Summarise this document in one sentence.\n\n" + text)


def alone(loaded, prompt: list[int], **params) -> Run:
    run = Run(loaded)
    run.submit("solo", prompt, **params)
    run.drain()
    return run


def test_greedy_alone_equals_batched_and_joining(loaded, prompts):
    solo = [alone(loaded, p, max_tokens=10).tokens("solo") for p in prompts[:5]]
    together = Run(loaded)
    for i, p in enumerate(prompts[:5]):
        together.submit(f"r{i}", p, max_tokens=10)
    together.drain()
    assert together.scheduler.peak_running == 5
    staggered = Run(loaded)
    for i, p in enumerate(prompts[:5]):  # each joins a batch that is already decoding
        staggered.submit(f"r{i}", p, max_tokens=10)
        staggered.steps(2)
    staggered.drain()
    for i in range(5):
        assert together.tokens(f"r{i}") == solo[i], QUESTIONS[i]
        assert staggered.tokens(f"r{i}") == solo[i], QUESTIONS[i]
    assert staggered.scheduler.blocks.num_free == staggered.scheduler.blocks.num_blocks  # idle: every block free


def test_chunked_prefill_and_prefix_hit_give_the_same_tokens(loaded, document):
    params = {"max_tokens": 24, "ignore_eos": True}
    whole = Run(loaded, prefill=4096, idle=4096)
    whole.submit("doc", document, **params)
    whole.drain()
    chunked = Run(loaded, prefill=7, idle=7)  # odd chunks that straddle blocks
    chunked.submit("doc", document, **params)
    chunked.drain()
    assert chunked.tokens("doc") == whole.tokens("doc")
    chunked.submit("again", document, **params)  # same engine: the prompt's blocks are cached
    chunked.drain()
    assert chunked.tokens("again") == whole.tokens("doc")
    blocks = chunked.scheduler.blocks
    assert blocks.hit_tokens >= (len(document) - 1) // BLOCK * BLOCK


def test_shared_system_prompt_hits_and_answers_stay_right(loaded, prompts):
    solo = [alone(loaded, p).tokens("solo") for p in prompts[:4]]
    run = Run(loaded)
    for i, p in enumerate(prompts[:4]):
        run.submit(f"r{i}", p)
        run.drain()
    assert run.scheduler.blocks.hit_tokens >= 3 * BLOCK  # the template's system turn, once per later request
    assert [run.tokens(f"r{i}") for i in range(4)] == solo


def test_prefix_hit_after_eviction_pressure(loaded, prompts, document):
    want = alone(loaded, document, max_tokens=12, ignore_eos=True).tokens("solo")
    blocks = -(-(len(document) + 12) // BLOCK) + 4
    run = Run(loaded, num_blocks=blocks, prefill=64, idle=64)
    run.submit("first", document, max_tokens=12, ignore_eos=True)
    run.drain()
    for i, p in enumerate(prompts[:3]):  # other requests evict some of the document's blocks, tail first
        run.submit(f"o{i}", p, max_tokens=24, ignore_eos=True)
        run.drain()
    run.submit("again", document, max_tokens=12, ignore_eos=True)
    run.drain()
    assert run.tokens("first") == want and run.tokens("again") == want


def test_preemption_under_a_tiny_cache_loses_nothing(loaded, prompts):
    solo = [alone(loaded, p, max_tokens=40, ignore_eos=True).tokens("solo") for p in prompts[:3]]
    longest = max(len(p) for p in prompts[:3]) + 40
    blocks = 2 * -(-longest // BLOCK) - 1  # two are admitted, but cannot both grow to their longest
    run = Run(loaded, num_blocks=blocks)
    for i, p in enumerate(prompts[:3]):
        run.submit(f"r{i}", p, max_tokens=40, ignore_eos=True)
    run.drain()
    assert run.scheduler.preemptions > 0
    assert run.max_blocks_used <= blocks
    assert run.failed() == []
    for i in range(3):
        assert run.tokens(f"r{i}") == solo[i]
        assert run.finish(f"r{i}").usage.completion_tokens == 40


def test_seeded_sampling_same_alone_batched_chunked_preempted(loaded, prompts, document):
    params = {"temperature": 0.8, "seed": 1234, "max_tokens": 30, "ignore_eos": True}
    solo = alone(loaded, prompts[1], **params).tokens("solo")
    assert solo == alone(loaded, prompts[1], **params).tokens("solo")
    batched = Run(loaded)
    for i, p in enumerate(prompts[:5]):
        if i != 1:
            batched.submit(f"o{i}", p, temperature=1.0, top_p=0.9, seed=i if i % 2 else None, max_tokens=12)
    batched.steps(2)
    batched.submit("seeded", prompts[1], **params)
    batched.drain()
    assert batched.tokens("seeded") == solo
    chunked = Run(loaded, prefill=5, idle=5)
    chunked.submit("seeded", prompts[1], **params)
    chunked.drain()
    assert chunked.tokens("seeded") == solo
    longest = max(len(prompts[0]), len(prompts[1])) + 30
    tiny = Run(loaded, num_blocks=2 * -(-longest // BLOCK) - 1)  # both admitted, both cannot grow
    tiny.submit("other", prompts[0], max_tokens=30, ignore_eos=True)
    tiny.submit("seeded", prompts[1], **params)
    tiny.drain()
    assert tiny.scheduler.preemptions > 0 and tiny.tokens("seeded") == solo
    assert alone(loaded, prompts[1], **{**params, "seed": 4321}).tokens("solo") != solo


def test_resumed_request_continues_token_for_token(loaded, prompts):
    """Request migration, worker side: given the first 9 tokens an earlier attempt made, the rest is
    what the undisturbed run made, the text is only the new part, and usage counts everything once."""
    full = alone(loaded, prompts[2], max_tokens=20, ignore_eos=True)
    want = full.tokens("solo")
    run = Run(loaded)
    run.submit("moved", prompts[2], output=want[:9], max_tokens=20, ignore_eos=True)
    run.drain()
    assert run.tokens("moved") == want[9:]
    assert full.text("solo").endswith(run.text("moved")) and len(run.text("moved")) < len(full.text("solo"))
    usage = run.finish("moved").usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompts[2]), 20)


def test_long_document_does_not_freeze_running_streams(loaded, prompts, document):
    """By event order: while the document prefills in chunks, every running chat stream keeps
    getting tokens, one per step."""
    run = Run(loaded, prefill=32, idle=512)
    for i in range(4):
        run.submit(f"chat{i}", prompts[i], max_tokens=120, ignore_eos=True)
    run.steps(2)
    run.submit("doc", document, max_tokens=4)
    mark, steps = len(run.events), 0
    while not run.tokens("doc"):
        run.steps(1)
        steps += 1
    assert steps >= (len(document) - 2 * BLOCK) // 32  # the document took many steps (its template head cached)
    during = [e.request_id for e in run.events[mark:] if isinstance(e, Tokens)]
    for i in range(4):
        assert during.count(f"chat{i}") == steps, (during.count(f"chat{i}"), steps)  # one token each step


def test_chunks_sized_by_step_costs_shrink_along_a_document_and_change_no_token(loaded, prompts, document):
    """With step costs (made up here: an attention that soon outweighs the tokens' matmuls) the
    document beside two running chats is prefilled in chunks that shrink with its position, and its
    tokens are those it gets alone, the chats' those they get alone."""
    cost = StepCost(decode_s=0.02, decode_row_s=0.001, chunk_s=0.002, token_s=0.001, key_s=5e-6, ratio=3.0)
    run = Run(loaded, prefill=32, idle=512, cost=cost)
    for i in range(2):
        run.submit(f"chat{i}", prompts[i], max_tokens=24, ignore_eos=True)
    run.steps(2)
    run.submit("doc", document, max_tokens=8, ignore_eos=True)
    chunks, schedule = [], run.scheduler.schedule
    run.scheduler.schedule = lambda: chunks.append(schedule()) or chunks[-1]
    while not run.tokens("doc"):
        run.steps(1)
    sizes = [e - b for plan in chunks for seq, b, e in plan.prefill if seq.request_id == "doc"]
    assert len(sizes) > 3 and sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-2], sizes
    run.drain()
    assert run.tokens("doc") == alone(loaded, document, max_tokens=8, ignore_eos=True).tokens("solo")
    for i in range(2):
        assert run.tokens(f"chat{i}") == alone(loaded, prompts[i], max_tokens=24, ignore_eos=True).tokens("solo")


def test_burst_of_short_prompts_is_prefilled_together(loaded, prompts):
    run = Run(loaded, prefill=32, idle=512)
    for i, p in enumerate(prompts):
        run.submit(f"r{i}", p)
    run.steps(1)
    firsts = {e.request_id for e in run.events if isinstance(e, Tokens)}
    assert firsts == {f"r{i}" for i in range(8)}


def test_prompt_larger_than_the_cache_is_refused_naming_both_numbers(loaded, prompts):
    run = Run(loaded, num_blocks=4)
    run.submit("big", prompts[0], max_tokens=40)
    ((rid, code, message),) = run.failed()
    assert (rid, code) == ("big", 400)
    assert f"{len(prompts[0]) + 40} KV tokens" in message and f"holds {4 * BLOCK} tokens" in message


def test_cancel_running_and_waiting(loaded, prompts):
    run = Run(loaded, max_num_seqs=1)
    run.submit("a", prompts[0], max_tokens=50, ignore_eos=True)
    run.submit("b", prompts[1], max_tokens=50, ignore_eos=True)
    run.steps(3)
    run.engine.cancel("b")  # waiting: dropped at once
    assert list(run.scheduler.waiting) == []
    run.engine.cancel("a")  # running: leaves at the next step
    before = len(run.tokens("a"))
    run.steps(1)
    assert not run.engine.has_work and run.engine.by_id == {}
    assert len(run.tokens("a")) == before and run.tokens("b") == []
    assert run.scheduler.blocks.num_free == run.scheduler.blocks.num_blocks


def test_refusals_are_failed_messages(loaded, prompts):
    run = Run(loaded, max_num_seqs=1, max_waiting=1)
    run.submit("ok", prompts[0], max_tokens=5)
    run.steps(1)  # "ok" runs
    run.submit("queued", prompts[0], max_tokens=5)  # waits
    run.submit("full", prompts[0], max_tokens=5)  # 1 running + 1 waiting: full
    run.submit("ok", prompts[0], max_tokens=5)  # duplicate id
    run.submit("oov", [10**6], max_tokens=5)
    assert [(r, c) for r, c, _ in run.failed()] == [("full", 429), ("ok", 400), ("oov", 400)]
    run.drain()
    assert run.finish("ok").finish_reason in ("stop", "length")
    assert run.finish("queued").finish_reason in ("stop", "length")


class FlakyRunner:
    """Raises ``torch.OutOfMemoryError`` on chosen calls, else runs the real runner."""

    def __init__(self, runner: ModelRunner, fail_calls: set[int] | None = None, always: bool = False):
        self.runner, self.fail_calls, self.always, self.calls = runner, fail_calls or set(), always, 0

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def run(self, plan):
        self.calls += 1
        if self.always or self.calls in self.fail_calls:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return self.runner.run(plan)


def test_out_of_memory_in_a_step_is_survived(loaded, prompts):
    solo = [alone(loaded, p, max_tokens=12).tokens("solo") for p in prompts[:3]]
    run = Run(loaded)
    run.engine.runner = FlakyRunner(run.engine.runner, fail_calls={1, 4, 5})
    for i, p in enumerate(prompts[:3]):
        run.submit(f"r{i}", p, max_tokens=12)
    run.drain()
    assert run.engine.oom_events == 3 and run.failed() == []
    assert [run.tokens(f"r{i}") for i in range(3)] == solo


def test_lone_request_that_never_fits_gets_503(loaded, prompts):
    run = Run(loaded, prefill=16, idle=16)
    run.engine.runner = FlakyRunner(run.engine.runner, always=True)
    run.submit("a", prompts[0], max_tokens=4)
    run.drain()
    ((rid, code, _),) = run.failed()
    assert (rid, code) == ("a", 503) and not run.engine.has_work
    assert next(e for e in run.events if isinstance(e, Failed)).retry_after_s > 0  # the client retries later


def test_non_finite_logits_fail_that_request_only(loaded, prompts):
    run = Run(loaded)
    real = run.engine.runner.run

    def poisoned(plan):
        logits = real(plan).clone()
        for row, seq in enumerate(plan.decode):
            if seq.request_id == "bad":
                logits[row] = float("nan")
        return logits

    run.engine.runner.run = poisoned
    run.submit("good", prompts[0], max_tokens=8)
    run.submit("bad", prompts[1], max_tokens=8)
    run.drain()
    assert [(r, c) for r, c, _ in run.failed()] == [("bad", 500)]
    assert run.finish("good").usage.completion_tokens >= 1


def first_token_step(run: Run, rid: str, limit: int = 500) -> int:
    for step in range(1, limit):
        run.steps(1)
        if run.tokens(rid):
            return step
    raise AssertionError(f"{rid} got no token in {limit} steps")


def test_question_beside_a_long_prefill_is_answered_first_with_the_same_tokens(loaded, prompts, document):
    """By steps: a short question that arrives while a document is prefilled gets its first token in
    the few steps its own prompt needs, not after the document's; its answer is the one it gets alone."""
    want = alone(loaded, prompts[5], max_tokens=8).tokens("solo")
    waited = {}
    for name, threshold in (("short first", 64), ("arrival order", 10**9)):
        run = Run(loaded, prefill=32, idle=512, shares=PrefillShares(long_threshold=threshold))
        for i in range(4):
            run.submit(f"chat{i}", prompts[i], max_tokens=200, ignore_eos=True)
        run.steps(2)
        run.submit("doc", document, max_tokens=4)
        run.steps(2)
        run.submit("question", prompts[5], max_tokens=8)
        waited[name] = first_token_step(run, "question")
        while len(run.tokens("question")) < len(want):
            run.steps(1)
        for i in range(4):  # their 200 tokens only had to outlast the document's prefill
            run.engine.cancel(f"chat{i}")
        run.drain()
        assert run.tokens("question") == want and run.failed() == []
    assert waited["short first"] <= -(-len(prompts[5]) // 24) + 1  # 3/4 of the 32-token budget per step at least
    assert waited["arrival order"] > waited["short first"] + 3


def test_interactive_request_preempts_a_flex_one_which_resumes_with_the_same_tokens(loaded, prompts):
    params = {"max_tokens": 40, "ignore_eos": True}
    want_flex = alone(loaded, prompts[1], **params).tokens("solo")
    want_chat = alone(loaded, prompts[0], max_tokens=8).tokens("solo")
    run = Run(loaded, num_blocks=-(-(len(prompts[1]) + 40) // BLOCK))  # the flex one alone fills the cache
    run.submit("flex", prompts[1], flex=True, **params)
    run.steps(6)
    assert run.scheduler.preemptions == 0 and len(run.tokens("flex")) >= 4
    run.submit("chat", prompts[0], max_tokens=8)
    run.steps(1)
    assert run.scheduler.preemptions == 1 and [s.request_id for s in run.scheduler.running] == ["chat"]
    run.drain()
    assert run.tokens("chat") == want_chat and run.failed() == []
    assert run.tokens("flex") == want_flex  # resumed after recomputing: the same text, nothing sent twice
    assert run.finish("flex").usage.completion_tokens == 40


def test_interactive_request_takes_a_flex_ones_seat_which_resumes_with_the_same_tokens(loaded, prompts):
    params = {"max_tokens": 24, "ignore_eos": True}
    want_flex = alone(loaded, prompts[2], **params).tokens("solo")
    run = Run(loaded, max_num_seqs=1)  # memory to spare, one seat
    run.submit("flex", prompts[2], flex=True, **params)
    run.steps(5)
    assert len(run.tokens("flex")) >= 2
    run.submit("chat", prompts[3], max_tokens=4)
    run.steps(1)
    assert run.scheduler.preemptions == 1 and [s.request_id for s in run.scheduler.running] == ["chat"]
    run.drain()
    assert run.tokens("flex") == want_flex and run.failed() == []  # its prompt and tokens found in the prefix cache
