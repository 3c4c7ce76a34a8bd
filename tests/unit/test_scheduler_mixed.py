"""The scheduler under the mixed workload (documents beside chat), in steps: pure logic, no model.

Four chat clients in a closed loop (short prompts, 48 tokens each) alone, then beside two document
pipelines (prompts of ~1,370 tokens), through the real :class:`~worker.scheduler.Scheduler` and
:class:`~worker.blocks.BlockManager`. A step costs one decode step plus its prefill tokens over the
budget (a full chunk doubles a step: what the CPU calibration allows), so a chat's time to first
token is counted in decode steps, whatever the machine's load. This is the structure the mixed
benchmark measures on a real deployment (``bench --suite mixed``)."""

from __future__ import annotations

import random

import pytest

from tests.unit.test_scheduler import Seq
from worker.blocks import BlockManager
from worker.scheduler import PrefillShares, Scheduler


class Mix:
    """The closed loop: a finished chat or document is replaced by a new one at once."""

    def __init__(self, budget: int, documents: bool, seed: int = 1):
        self.rng = random.Random(seed)
        self.s = Scheduler(
            BlockManager(3000, 16), 8, 64, budget, idle_prefill_tokens=4 * budget, shares=PrefillShares()
        )
        self.budget, self.clock, self.serial = budget, 0.0, 0
        self.ttft: list[float] = []
        self.documents_done = 0
        for _ in range(4):
            self.chat()
        for _ in range(2 if documents else 0):
            self.document()

    def new(self, kind: str, prompt: int, output: int) -> Seq:
        self.serial += 1
        seq = Seq(f"{kind}{self.serial}", prompt, max_output=output, base=100_000 * self.serial)
        seq.sent = self.clock
        self.s.add(seq)
        return seq

    def chat(self) -> None:
        self.new("chat", self.rng.randint(33, 57), 48)

    def document(self) -> None:
        self.new("doc", self.rng.randint(1270, 1470), self.rng.randint(60, 160))

    def step(self) -> None:
        plan = self.s.schedule()
        self.clock += 1 + sum(end - start for _, start, end in plan.prefill) / self.budget
        for seq in self.s.finish_step(plan):
            if not seq.output and seq.request_id.startswith("chat"):
                self.ttft.append(self.clock - seq.sent)
            seq.output.append(7)
        for seq in self.s.retire({q.request_id for q in self.s.running if len(q.output) >= q.max_output}):
            if seq.request_id.startswith("chat"):
                self.chat()
            else:
                self.documents_done += 1
                self.document()

    def p95(self, steps: int) -> float:
        for _ in range(steps):
            self.step()
        return sorted(self.ttft)[int(0.95 * (len(self.ttft) - 1))]


@pytest.mark.parametrize("budget", [16, 32, 64])
def test_chat_ttft_p95_beside_documents_within_twice_alone(budget):
    alone = Mix(budget, documents=False).p95(1500)
    mix = Mix(budget, documents=True)
    beside = mix.p95(1500)
    assert mix.documents_done >= 3  # the documents go on
    assert beside <= 2 * alone, (alone, beside)
