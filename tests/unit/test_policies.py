from dataclasses import dataclass
from pathlib import Path

import pytest

import router.policies
from router.policies.base import Routed
from router.policies.least_loaded import LeastLoaded
from router.policies.prefix_affinity import PrefixAffinity, block_hashes
from router.policies.registry import POLICIES, REGISTERED, PolicyName, make_policy
from router.policies.round_robin import RoundRobin
from router.settings import RouterConfig


@dataclass
class W:
    worker_id: int
    in_flight: int = 0
    block_size: int = 16
    kv_budget_tokens: int = 16 * 1000


def asking(prompt: list[int]) -> Routed:
    return Routed(prompt=prompt)


def test_round_robin_rotates_in_id_order_and_skips_missing():
    rr = RoundRobin()
    ws = [W(2), W(0), W(1)]
    assert [rr.pick(ws).worker_id for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    # worker 1 leaves: rotation continues from where it was
    assert [rr.pick([W(0), W(2)]).worker_id for _ in range(3)] == [0, 2, 0]


def test_round_robin_ignores_load():
    rr = RoundRobin()
    assert [rr.pick([W(0, 5), W(1, 0)]).worker_id for _ in range(4)] == [0, 1, 0, 1]


def test_least_loaded_picks_fewest_in_flight():
    ll = LeastLoaded()
    assert ll.pick([W(0, 3), W(1, 1), W(2, 2)]).worker_id == 1


def test_least_loaded_breaks_ties_by_rotation():
    ll = LeastLoaded()
    ws = [W(0), W(1), W(2)]
    assert [ll.pick(ws).worker_id for _ in range(4)] == [0, 1, 2, 0]


def test_no_candidates():
    assert RoundRobin().pick([]) is None and LeastLoaded().pick([]) is None
    assert make_policy("least_loaded").name == "least_loaded"


# ---- cache-aware tie-breaking ------------------------------------------------------------------

DOC = list(range(1000, 1000 + 16 * 40))  # a 640-token document: 40 full blocks


def affinity_for(*workers: int, capacity: int = 1000) -> PrefixAffinity:
    aff = PrefixAffinity()
    for wid in workers:
        aff.configure(wid, 16, capacity)
    return aff


def test_block_hashes_chain_over_full_blocks_only():
    a = block_hashes(list(range(40)), 16)
    assert len(a) == 2  # 8 trailing tokens make no block
    assert block_hashes(list(range(32)), 16) == a
    # the same second block after a different first one is a different prefix
    assert block_hashes([7, *list(range(1, 32))], 16)[1] != a[1]


def test_a_repeated_document_goes_back_to_the_idle_worker_that_prefilled_it():
    ll = LeastLoaded()
    ws = [W(0), W(1)]
    first = ll.pick(ws, asking([*DOC, 1, 2, 3]))
    ll.on_dispatch(first, asking([*DOC, 1, 2, 3]))
    # rotation alone would now pick the other worker; the cache says this one holds the document
    again = [ll.pick(ws, asking([*DOC, 9, 9])).worker_id for _ in range(3)]
    assert again == [first.worker_id] * 3
    assert ll.affinity.cached(first.worker_id, DOC) == (1.0, 40)


def test_affinity_never_outweighs_load():
    ll = LeastLoaded()
    ll.on_dispatch(W(0), asking(DOC))
    assert ll.pick([W(0, 1), W(1, 0)], asking(DOC)).worker_id == 1


def test_short_or_mostly_new_prompts_keep_the_rotation():
    ll = LeastLoaded()
    template = DOC[: 16 * 7]  # a shared 7-block system prompt: under AFFINITY_MIN_BLOCKS
    ll.on_dispatch(W(0), asking(template + [5] * 40))
    picks = [ll.pick([W(0), W(1)], asking(template + [6] * 40)).worker_id for _ in range(4)]
    assert picks == [0, 1, 0, 1]
    # 10 blocks held of a 40-block prompt: under AFFINITY_MIN_SHARE
    ll.on_dispatch(W(0), asking(DOC[:160]))
    mostly_new = DOC[:160] + [8] * 480
    assert [ll.pick([W(0), W(1)], asking(mostly_new)).worker_id for _ in range(2)] == [0, 1]


def test_a_workers_record_is_bounded_by_its_cache_and_forgotten_on_restart():
    aff = affinity_for(0, capacity=10)
    aff.record(0, DOC)
    assert aff.cached(0, DOC) == (0.25, 10)  # the tail was pushed out, the first 10 blocks kept
    aff.record(0, DOC[:160])
    assert aff.cached(0, DOC[:160]) == (1.0, 10)
    aff.forget(0)
    assert aff.cached(0, DOC[:160]) == (0.0, 0)
    unconfigured = PrefixAffinity()
    unconfigured.record(3, DOC)  # a worker that reported no block size: nothing recorded
    assert unconfigured.cached(3, DOC) == (0.0, 0)


def test_round_robin_is_not_cache_aware():
    rr = RoundRobin()
    rr.on_dispatch(W(0), asking(DOC))
    assert [rr.pick([W(0), W(1)], asking(DOC)).worker_id for _ in range(2)] == [0, 1]


def test_the_record_forgets_a_prompts_tail_before_its_head_as_the_worker_does():
    """The worker frees a finished sequence's blocks tail first (worker/blocks.py), so when newer
    prompts push it out its prefix is what stays cached: the router's record keeps the same part."""
    ll, w0 = LeastLoaded(), W(0, kv_budget_tokens=16 * 50)
    ll.on_dispatch(w0, asking(DOC))  # 40 blocks on worker 0
    ll.on_dispatch(w0, asking(list(range(5000, 5000 + 16 * 20))))  # 20 more: 10 of the document's blocks go
    assert ll.affinity.cached(0, DOC) == (0.75, 30)  # its first 30 blocks, as worker 0's cache holds them
    ll.took(w0)  # rotation alone would pick worker 1 next
    assert ll.pick([W(0), W(1)], asking(DOC)).worker_id == 0


# ---- cache_aware: a cached prefix first, within its slack ----------------------------------------


def test_cache_aware_sends_a_cached_document_to_a_somewhat_busier_worker():
    ca = make_policy("cache_aware")
    ca.on_dispatch(W(0), asking(DOC))
    assert ca.slack == 2
    # two more in flight than the least loaded: the cached prefix still wins
    assert ca.pick([W(0, 2), W(1, 0)], asking([*DOC, 7])).worker_id == 0
    # three more: load wins
    assert ca.pick([W(0, 3), W(1, 0)], asking([*DOC, 7])).worker_id == 1


def test_cache_aware_without_a_cached_prefix_is_least_loaded_with_rotation():
    ca = make_policy("cache_aware")
    assert ca.pick([W(0, 2), W(1, 1), W(2, 1)], asking(DOC)).worker_id == 1
    assert ca.pick([W(0, 2), W(1, 1), W(2, 1)], asking(DOC)).worker_id == 2
    assert ca.pick([W(0, 0), W(1, 0)]).worker_id == 0  # no prompt (an embedding request): load and rotation


def test_cache_aware_prefers_the_less_loaded_of_two_workers_holding_the_prompt():
    ca = make_policy("cache_aware")
    for wid in (0, 1):
        ca.on_dispatch(W(wid), asking(DOC))
    assert ca.pick([W(0, 2), W(1, 1), W(2, 0)], asking(DOC)).worker_id == 1


def test_a_worker_gone_is_forgotten_and_one_without_a_prefix_cache_is_never_recorded():
    ca = make_policy("cache_aware")
    ca.on_dispatch(W(0), asking(DOC))
    ca.on_worker_gone(0)
    assert ca.affinity.cached(0, DOC) == (0.0, 0)
    assert [ca.pick([W(0), W(1)], asking(DOC)).worker_id for _ in range(2)] == [0, 1]
    ca.on_dispatch(W(3, block_size=0), asking(DOC))  # reported no block size
    assert ca.affinity.cached(3, DOC) == (0.0, 0)
    ca.on_finish(0, "req-1")  # a finished prompt stays cached: nothing to forget
    ca.on_dispatch(W(0), asking(DOC))
    ca.on_finish(0, "req-2")
    assert ca.affinity.cached(0, DOC) == (1.0, 40)


def test_each_instance_owns_its_own_table():
    a, b = make_policy("least_loaded"), make_policy("least_loaded")
    a.on_dispatch(W(0), asking(DOC))
    assert a.affinity.cached(0, DOC) == (1.0, 40) and b.affinity.cached(0, DOC) == (0.0, 0)


# ---- the registry -------------------------------------------------------------------------------


def test_every_registered_policy_is_one_module_named_for_it_with_every_hook():
    folder = Path(router.policies.__file__).parent
    assert list(POLICIES) == list(REGISTERED) == list(PolicyName.__args__)
    assert REGISTERED[0] == "least_loaded"  # the config's default comes first
    for name, cls in POLICIES.items():
        assert cls.name == name and (folder / f"{name}.py").is_file()
        assert f"{name}: {cls.summary}" in RouterConfig.model_fields["policy"].description  # the config's help
        assert cls.__module__ == f"router.policies.{name}"
        policy = make_policy(name)
        assert policy is not make_policy(name)  # a fresh instance, fresh state, each time
        for hook in ("pick", "on_dispatch", "on_finish", "on_worker_gone"):
            assert callable(getattr(policy, hook))
        assert policy.pick([]) is None
        assert policy.pick([W(4)], asking(DOC)).worker_id == 4


def test_an_unknown_policy_is_a_key_error():
    with pytest.raises(KeyError):
        make_policy("random")
