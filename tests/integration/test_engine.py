"""Issue 6: the engine in process, on the real embedded model (float32 on CPU), loaded once per module.

Continuous batching must not change what a sequence generates: greedy output and seeded sampling
are the same alone, batched from the start, or joining a batch that is already decoding.
"""

from __future__ import annotations

import pytest
import torch

from launcher.models import resolve_model
from worker import model as model_mod
from worker.engine import Engine
from worker.protocol import Failed, Generate, SamplingParams, Tokens
from worker.sampling import RowSampler, sample_batch
from worker.scheduler import Scheduler

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain gravity to a child.",
    "List three colors.", "Who wrote Hamlet?", "Translate 'good morning' to Spanish.",
    "What is 12 times 12?", "Tell me a joke about cats.",
]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def loaded():
    path = resolve_model("smollm2-135m-instruct", progress=False)
    return model_mod.load(str(path), CPU, torch.float32)


@pytest.fixture(scope="module")
def prompts(loaded) -> list[list[int]]:
    _, tok = loaded
    return [tok(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False),
                add_special_tokens=False)["input_ids"] for q in QUESTIONS]


class Run:
    """Drives one :class:`Engine` and records every message it emits, in order."""

    def __init__(self, loaded, max_num_seqs: int = 8, kv_budget_tokens: int = 1_000_000, max_waiting: int = 64):
        model, tok = loaded
        self.events: list = []
        self.engine = Engine(model, tok, Scheduler(max_num_seqs, max_waiting, kv_budget_tokens), 2048,
                             self.events.append, CPU)

    def submit(self, rid: str, prompt: list[int], **params) -> None:
        params.setdefault("max_tokens", 16)
        params.setdefault("temperature", 0.0)
        self.engine.submit(Generate(request_id=rid, prompt_token_ids=prompt, params=SamplingParams(**params)))

    def steps(self, n: int) -> None:
        for _ in range(n):
            if self.engine.has_work:
                self.engine.step()

    def drain(self) -> None:
        while self.engine.has_work:
            self.engine.step()

    def tokens(self, rid: str) -> list[int]:
        return [t for e in self.events if isinstance(e, Tokens) and e.request_id == rid for t in e.token_ids]

    def text(self, rid: str) -> str:
        return "".join(e.text_delta for e in self.events if isinstance(e, Tokens) and e.request_id == rid)

    def finish(self, rid: str) -> Tokens:
        return next(e for e in self.events if isinstance(e, Tokens) and e.request_id == rid and e.finish_reason)


def alone(loaded, prompt: list[int], **params) -> Run:
    run = Run(loaded)
    run.submit("solo", prompt, **params)
    run.drain()
    return run


def test_greedy_alone_equals_batched_with_seven_others(loaded, prompts):
    """Test 1: token-identical greedy output alone, batched from the start, and joining mid-decode."""
    solo = [alone(loaded, p).tokens("solo") for p in prompts]
    together = Run(loaded)
    for i, p in enumerate(prompts):
        together.submit(f"r{i}", p)
    together.drain()
    assert together.engine.scheduler.peak_running == 8
    staggered = Run(loaded)
    for i, p in enumerate(prompts):  # each joins a batch that is already decoding
        staggered.submit(f"r{i}", p)
        staggered.steps(2)
    staggered.drain()
    for i in range(len(prompts)):
        assert together.tokens(f"r{i}") == solo[i], QUESTIONS[i]
        assert staggered.tokens(f"r{i}") == solo[i], QUESTIONS[i]
    assert staggered.engine.batch.size == 0 and not staggered.engine.batch.buffers  # idle: no KV memory held


def test_newcomer_longer_than_the_window_and_cursor_wraps(loaded, prompts):
    """A newcomer whose prompt is longer than the running window, and decoding past the buffer's
    slack, both re-lay the buffer; outputs must not change."""
    _, tok = loaded
    long_prompt = tok(" ".join(["The quick brown fox jumps over the lazy dog."] * 12))["input_ids"]
    solo_short = alone(loaded, prompts[0], max_tokens=40, ignore_eos=True).tokens("solo")
    solo_long = alone(loaded, long_prompt, max_tokens=6).tokens("solo")
    run = Run(loaded)
    run.engine.batch.max_slack = 6  # force several re-layouts in 40 steps
    run.submit("short", prompts[0], max_tokens=40, ignore_eos=True)
    run.steps(3)
    run.submit("long", long_prompt, max_tokens=6)
    run.drain()
    assert run.tokens("short") == solo_short
    assert run.tokens("long") == solo_long
    assert run.engine.batch.relayouts >= 3


def test_window_shifts_in_place_as_rows_come_and_go(loaded, prompts):
    """Rows finishing and joining while the cursor wraps: the window is shifted inside the buffer
    (not only re-allocated), and every output is still what the prompt gives alone."""
    lengths = [6, 20, 9, 14, 7, 18]
    solo = [alone(loaded, prompts[i], max_tokens=n, ignore_eos=True).tokens("solo") for i, n in enumerate(lengths)]
    run = Run(loaded)
    run.engine.batch.max_slack = 4
    for i, n in enumerate(lengths):
        run.submit(f"r{i}", prompts[i], max_tokens=n, ignore_eos=True)
        run.steps(3)
    run.drain()
    assert [run.tokens(f"r{i}") for i in range(len(lengths))] == solo
    batch = run.engine.batch
    assert batch.relayouts > batch.grows >= 1, (batch.relayouts, batch.grows)


def test_newcomer_gets_first_token_before_long_one_finishes(loaded, prompts):
    """Test 2, by event order: the short request's first token comes before the long one's last."""
    run = Run(loaded)
    run.submit("long", prompts[2], max_tokens=30, ignore_eos=True)
    run.steps(5)
    run.submit("short", prompts[0], max_tokens=4)
    run.drain()
    order = [(e.request_id, e.finish_reason) for e in run.events if isinstance(e, Tokens)]
    first_short = next(i for i, (rid, _) in enumerate(order) if rid == "short")
    last_long = next(i for i, (rid, fin) in enumerate(order) if rid == "long" and fin)
    assert first_short < last_long
    short_done = next(i for i, (rid, fin) in enumerate(order) if rid == "short" and fin)
    assert short_done < last_long  # and it finished while the long one still ran
    assert run.finish("long").usage.completion_tokens == 30


def test_seed_reproducible_alone_and_in_batch(loaded, prompts):
    """Test 5: the same seed with temperature 0.8 gives the same text alone and in a batch."""
    params = {"temperature": 0.8, "seed": 1234, "max_tokens": 16}
    solo = alone(loaded, prompts[1], **params).text("solo")
    again = alone(loaded, prompts[1], **params).text("solo")
    assert solo == again
    run = Run(loaded)
    for i, p in enumerate(prompts):
        if i != 1:  # others sample too, with their own seeds or none
            run.submit(f"o{i}", p, temperature=1.0, top_p=0.9, seed=i if i % 2 else None, max_tokens=16)
    run.steps(2)
    run.submit("seeded", prompts[1], **params)
    run.drain()
    assert run.text("seeded") == solo
    different = alone(loaded, prompts[1], **{**params, "seed": 4321}).text("solo")
    assert different != solo  # the seed matters


def test_per_sequence_sampling_in_one_batch(loaded, prompts):
    """Each row keeps its own parameters: top_k=1 sampling is greedy, stop strings and length apply per row."""
    greedy = alone(loaded, prompts[0]).text("solo")
    assert "Paris" in greedy
    run = Run(loaded)
    run.submit("topk1", prompts[0], temperature=1.0, top_k=1)
    run.submit("stop", prompts[0], stop=["Paris"])
    run.submit("len", prompts[2], max_tokens=3)
    run.submit("hot", prompts[3], temperature=1.5, top_p=0.5, seed=7)
    run.drain()
    assert run.text("topk1") == greedy
    assert run.text("stop") == greedy[: greedy.index("Paris")] and run.finish("stop").finish_reason == "stop"
    assert run.finish("len").finish_reason == "length" and run.finish("len").usage.completion_tokens == 3


def test_cancel_running_and_waiting(loaded, prompts):
    run = Run(loaded, max_num_seqs=1)
    run.submit("a", prompts[0], max_tokens=50, ignore_eos=True)
    run.submit("b", prompts[1], max_tokens=50, ignore_eos=True)
    run.steps(3)
    run.engine.cancel("b")  # waiting: dropped at once
    assert [s.request_id for s in run.engine.scheduler.waiting] == []
    run.engine.cancel("a")  # running: leaves at the next step
    before = len(run.tokens("a"))
    run.steps(1)
    assert not run.engine.has_work and run.engine.by_id == {}
    assert len(run.tokens("a")) == before and run.tokens("b") == []
    assert run.engine.batch.size == 0 and not run.engine.batch.buffers


def test_refusals_are_failed_messages(loaded, prompts):
    run = Run(loaded, max_num_seqs=1, kv_budget_tokens=100, max_waiting=1)
    run.submit("too-large", prompts[0], max_tokens=90)  # prompt + 90 > 100: could never run
    run.submit("ok", prompts[0], max_tokens=5)
    run.steps(1)                                        # "ok" runs
    run.submit("queued", prompts[0], max_tokens=5)      # waits
    run.submit("full", prompts[0], max_tokens=5)        # 1 running + 1 waiting: full
    run.submit("ok", prompts[0], max_tokens=5)          # duplicate id
    run.submit("oov", [10**6], max_tokens=5)
    failed = [(e.request_id, e.code) for e in run.events if isinstance(e, Failed)]
    assert failed == [("too-large", 400), ("full", 429), ("ok", 400), ("oov", 400)]
    run.drain()
    assert run.finish("ok").finish_reason in ("stop", "length")
    assert run.finish("queued").finish_reason in ("stop", "length")


def test_sampler_rows_are_independent():
    """A seeded row draws from its own generator: what else is in the batch does not matter."""
    torch.manual_seed(0)
    logits = torch.randn(4, 1000)
    seeded = [RowSampler(0.8, 0.95, 50, 99, CPU) for _ in range(2)]
    alone_tokens = [seeded[0].sample(logits[2]) for _ in range(20)]
    batch_tokens = []
    others = [RowSampler(1.0, 1.0, 0, None, CPU), RowSampler(0.0, 1.0, 0, None, CPU), seeded[1],
              RowSampler(1.2, 0.5, 0, 5, CPU)]
    for _ in range(20):
        batch_tokens.append(sample_batch(logits, others)[2])
    assert alone_tokens == batch_tokens
    assert sample_batch(logits, [RowSampler(0.0, 1.0, 0, None, CPU)] * 4) == logits.argmax(-1).tolist()


def test_top_p_and_top_k_restrict_the_support():
    logits = torch.tensor([5.0, 4.0, 1.0, 0.0, -1.0])
    top_k = RowSampler(1.0, 1.0, 2, 3, CPU)
    assert {top_k.sample(logits) for _ in range(200)} <= {0, 1}
    top_p = RowSampler(1.0, 0.5, 0, 3, CPU)  # p(token 0) ≈ 0.71 ≥ 0.5: only token 0 survives
    assert {top_p.sample(logits) for _ in range(50)} == {0}
