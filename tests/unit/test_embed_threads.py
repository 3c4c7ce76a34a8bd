"""The embedding forward pass's thread count: one thread for a small batch, all cores for a large one."""

from __future__ import annotations

import torch

from worker.embed.threads import PARALLEL_TOKENS, ThreadPlan


def test_a_small_batch_runs_on_one_thread_and_a_large_one_on_every_core():
    plan = ThreadPlan(cores=4)
    assert plan.threads_for(12) == 1
    assert plan.threads_for(PARALLEL_TOKENS - 1) == 1
    assert plan.threads_for(PARALLEL_TOKENS) == 4


def test_the_cores_default_to_torchs_thread_count_and_apply_sets_it():
    before = torch.get_num_threads()
    try:
        plan = ThreadPlan()
        assert plan.cores == before
        plan.apply(1)
        assert torch.get_num_threads() == 1
        plan.apply(PARALLEL_TOKENS)
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)
