"""Where a request is scheduled (router.routing) and how the router counts load (router.ledger):
the pool asks the policy in force, one instance per served model, and tells that instance what
happened; pure logic over the real frame-decoding pool, no process."""

from __future__ import annotations

import asyncio

import pytest

from router.ledger import Ledger
from router.routing import Overloaded
from router.slot import Worker
from router.workers import State
from tests.helpers.router_pool import PARAMS, RecordingPool
from worker.contract.protocol import Generate, Ready

DOC = list(range(1000, 1000 + 16 * 40))  # 40 full blocks of 16 tokens


def cached_pool(policy: str, models: dict[int, str]) -> RecordingPool:
    """Workers ready with a 16-token-block prefix cache of 1,000 blocks each, under ``policy``."""
    pool = RecordingPool()
    pool.routing.set_policy(policy)
    for wid, model in models.items():
        pool.boot(wid, pid=100 + wid, model=model)
        pool.frame(wid, Ready(worker_id=wid, load_seconds=1.0, kv_budget_tokens=16 * 1000, block_size=16))
        assert pool.workers[wid].block_size == 16 and pool.workers[wid].state == State.READY
    return pool


def serve(pool: RecordingPool, prompt: list[int], model: str | None = None) -> int:
    """One request through pick, register, send and finish; returns the worker it went to."""
    worker = pool.pick(prompt=prompt, model=model)
    req = pool.register(worker, pool.new_request_id())
    gen = Generate(request_id=req.request_id, prompt_token_ids=prompt, params=PARAMS)
    asyncio.run(pool.send_generate(req, gen))
    pool.finish(req, ok=True)
    return worker.worker_id


def test_a_repeated_document_returns_to_its_worker_until_that_worker_restarts():
    pool = cached_pool("least_loaded", {0: "m", 1: "m"})
    first = serve(pool, DOC)
    assert [serve(pool, [*DOC, k]) for k in range(3)] == [first] * 3
    pool.on_started(first, pid=999, restarts=1, device="cpu", model="m")  # a new process: an empty cache
    pool.frame(first, Ready(worker_id=first, load_seconds=1.0, kv_budget_tokens=16 * 1000, block_size=16))
    assert pool.policy.affinity.cached(first, DOC) == (0.0, 0)


def test_a_lost_worker_is_forgotten_by_the_policy():
    pool = cached_pool("cache_aware", {0: "m", 1: "m"})
    first = serve(pool, DOC)
    pool.mark_lost(first, "killed by SIGKILL")
    assert pool.policy.affinity.cached(first, DOC) == (0.0, 0)
    assert serve(pool, DOC) == 1 - first


def test_round_robin_alternates_whatever_the_prompt():
    pool = cached_pool("round_robin", {0: "m", 1: "m"})
    assert [serve(pool, DOC) for _ in range(4)] == [0, 1, 0, 1]


def test_each_model_has_its_own_instance_and_a_new_policy_starts_fresh():
    pool = cached_pool("least_loaded", {0: "a", 1: "a", 2: "b", 3: "b"})
    on_a = serve(pool, DOC, model="a")
    assert pool.routing.for_model("a").affinity.cached(on_a, DOC) == (1.0, 40)
    assert pool.routing.for_model("b").affinity.cached(on_a, DOC) == (0.0, 0)
    assert pool.policy.affinity.cached(on_a, DOC) == (0.0, 0)  # the one-model path's instance saw nothing
    assert serve(pool, [*DOC, 1], model="a") == on_a
    old = pool.routing.for_model("a")
    pool.routing.set_policy("round_robin")
    assert pool.routing.for_model("a") is not old and pool.table().policy == "round_robin"
    assert [serve(pool, DOC, model="b") for _ in range(2)] == [2, 3]


def test_a_full_worker_is_no_candidate_and_all_full_is_429():
    pool = cached_pool("cache_aware", {0: "m", 1: "m"})
    first = serve(pool, DOC)
    busy = pool.workers[first]
    held = [pool.register(busy, f"req-{i}") for i in range(busy.capacity)]
    assert pool.pick(prompt=DOC).worker_id == 1 - first  # the cached worker has no room
    other = [pool.register(pool.workers[1 - first], f"other-{i}") for i in range(busy.capacity)]
    with pytest.raises(Overloaded):
        pool.pick(prompt=DOC)
    for req in held + other:
        pool.finish(req, ok=False)
    assert busy.failed_requests == busy.capacity and busy.served == 1


def test_the_ledger_counts_each_request_once_and_knows_its_owner():
    ledger, w = Ledger(), Worker(0)
    req = ledger.register(w, "req-1")
    assert w.in_flight == 1 and ledger.owner_of("req-1") is req and ledger.in_flight() == 1
    assert ledger.finish(req, ok=True) and not ledger.finish(req, ok=False)
    assert (w.in_flight, w.served, w.failed_requests) == (0, 1, 0)
    assert ledger.owner_of("req-1") is None and ledger.in_flight() == 0
