"""The slow-turn watch of the serving loops (worker/contract/pauses.py), on fake clocks."""

from __future__ import annotations

import logging

from worker.contract.pauses import TurnWatch, cause


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def watch(slow_s=0.25):
    wall, cpu = Clock(), Clock()
    return TurnWatch("a turn", slow_s=slow_s, clock=wall, cpu=cpu), wall, cpu


def test_a_fast_turn_is_not_logged(caplog):
    w, wall, _ = watch()
    asked = []
    with caplog.at_level(logging.WARNING):
        w.begin()
        wall.now += 0.2
        assert w.end(lambda: asked.append(1) or "x") == 0.2
    assert not caplog.records and not asked and w.slow_turns == 0 and w.longest_s == 0.2


def test_a_slow_turn_is_logged_with_its_cpu_and_details(caplog):
    w, wall, cpu = watch()
    with caplog.at_level(logging.WARNING):
        w.begin()
        wall.now += 1.3
        cpu.now += 0.05
        w.end(lambda: "3 messages handled")
        w.begin()
        wall.now += 0.4
        cpu.now += 0.8  # two threads computing
        w.end()
    first, second = (r.getMessage() for r in caplog.records)
    assert first == "a turn took 1300 ms (50 ms of CPU: waiting or not scheduled): 3 messages handled"
    assert second == "a turn took 400 ms (800 ms of CPU: computing)"
    assert w.slow_turns == 2 and w.longest_s == 1.3


def test_cause_reads_the_two_clocks():
    assert cause(1.0, 0.5) == "computing"
    assert cause(1.0, 0.49) == "waiting or not scheduled"
