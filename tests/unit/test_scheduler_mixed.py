"""The scheduler under the mixed workload (documents beside chat), in steps: pure logic, no model.

Four chat clients in a closed loop (short prompts, 48 tokens each) alone, then beside two document
pipelines (prompts of ~1,370 tokens) or beside a batch's flex lines (8 in flight, the batch
runner's default, ~400-token prompts), through the real :class:`~worker.scheduler.Scheduler` and
:class:`~worker.blocks.BlockManager`. A step costs one decode step plus its prefill tokens over the
budget (a full chunk doubles a step: what the CPU calibration allows), so a chat's time to first
token is counted in decode steps, whatever the machine's load. This is the structure the mixed
benchmark measures on a real deployment (``bench --suite mixed``, ``scripts/batch_bench.py``)."""

from __future__ import annotations

import random

import pytest

from tests.unit.test_scheduler import Seq
from worker.blocks import BlockManager
from worker.scheduler import PrefillShares, Scheduler


class Mix:
    """The closed loop: a finished document or batch line is replaced by a new one at once, a
    finished chat after ``think`` steps (the client reading its answer and sending the next)."""

    def __init__(self, budget: int, documents: int = 0, lines: int = 0, think: int = 0, seed: int = 1):
        self.rng = random.Random(seed)
        self.s = Scheduler(
            BlockManager(3000, 16), 8, 64, budget, idle_prefill_tokens=4 * budget, shares=PrefillShares()
        )
        self.budget, self.clock, self.serial, self.steps, self.think = budget, 0.0, 0, 0, think
        self.ttft: list[float] = []
        self.due: list[int] = []  # the steps at which chat clients send their next question
        self.finished = 0  # documents or batch lines
        for _ in range(4):
            self.chat()
        for _ in range(documents):
            self.document()
        for _ in range(lines):
            self.line()

    def new(self, kind: str, prompt: int, output: int, flex: bool = False) -> None:
        self.serial += 1
        seq = Seq(f"{kind}{self.serial}", prompt, max_output=output, base=100_000 * self.serial, flex=flex)
        seq.sent = self.clock
        self.s.add(seq)

    def chat(self) -> None:
        self.new("chat", self.rng.randint(33, 57), 48)

    def document(self) -> None:
        self.new("doc", self.rng.randint(1270, 1470), self.rng.randint(60, 160))

    def line(self) -> None:
        self.new("line", self.rng.randint(380, 440), self.rng.randint(40, 96), flex=True)

    def step(self) -> None:
        self.steps += 1
        while self.steps in self.due:
            self.due.remove(self.steps)
            self.chat()
        plan = self.s.schedule()
        self.clock += 1 + sum(end - start for _, start, end in plan.prefill) / self.budget
        for seq in self.s.finish_step(plan):
            if not seq.output and seq.request_id.startswith("chat"):
                self.ttft.append(self.clock - seq.sent)
            seq.output.append(7)
        for seq in self.s.retire({q.request_id for q in self.s.running if len(q.output) >= q.max_output}):
            if seq.request_id.startswith("chat"):
                self.due.append(self.steps + max(1, self.think))
            else:
                self.finished += 1
                self.document() if seq.request_id.startswith("doc") else self.line()

    def p95(self, steps: int) -> float:
        for _ in range(steps):
            self.step()
        return sorted(self.ttft)[int(0.95 * (len(self.ttft) - 1))]


@pytest.mark.parametrize("budget", [16, 32, 64])
def test_chat_ttft_p95_beside_documents_within_twice_alone(budget):
    alone = Mix(budget).p95(1500)
    mix = Mix(budget, documents=2)
    beside = mix.p95(1500)
    assert mix.finished >= 3  # the documents go on
    assert beside <= 2 * alone, (alone, beside)


@pytest.mark.parametrize("budget", [16, 32, 64])
def test_chat_ttft_p95_during_a_batch_holding_every_seat_within_twice_alone(budget):
    alone = Mix(budget, think=2).p95(1500)
    mix = Mix(budget, lines=8, think=2)  # with the chats, more sequences than max_num_seqs (8)
    during = mix.p95(1500)
    assert mix.finished >= 10  # the batch goes on
    assert during <= 2 * alone, (alone, during)
