from dataclasses import dataclass

from router.policies import LeastLoaded, RoundRobin, make_policy
from router.prefix_affinity import PrefixAffinity, block_hashes


@dataclass
class W:
    worker_id: int
    in_flight: int = 0


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
    aff, ll = affinity_for(0, 1), LeastLoaded()
    ws = [W(0), W(1)]
    first = ll.pick(ws, lambda w: aff.cached(w.worker_id, [*DOC, 1, 2, 3]))
    aff.record(first.worker_id, [*DOC, 1, 2, 3])
    # rotation alone would now pick the other worker; the cache says this one holds the document
    again = [ll.pick(ws, lambda w: aff.cached(w.worker_id, [*DOC, 9, 9])).worker_id for _ in range(3)]
    assert again == [first.worker_id] * 3
    assert aff.cached(first.worker_id, DOC) == (1.0, 40)


def test_affinity_never_outweighs_load():
    aff, ll = affinity_for(0, 1), LeastLoaded()
    aff.record(0, DOC)
    assert ll.pick([W(0, 1), W(1, 0)], lambda w: aff.cached(w.worker_id, DOC)).worker_id == 1


def test_short_or_mostly_new_prompts_keep_the_rotation():
    aff, ll = affinity_for(0, 1), LeastLoaded()
    template = DOC[: 16 * 7]  # a shared 7-block system prompt: under AFFINITY_MIN_BLOCKS
    aff.record(0, template + [5] * 40)
    picks = [ll.pick([W(0), W(1)], lambda w: aff.cached(w.worker_id, template + [6] * 40)).worker_id for _ in range(4)]
    assert picks == [0, 1, 0, 1]
    # 10 blocks held of a 40-block prompt: under AFFINITY_MIN_SHARE
    aff.record(0, DOC[:160])
    mostly_new = DOC[:160] + [8] * 480
    assert [ll.pick([W(0), W(1)], lambda w: aff.cached(w.worker_id, mostly_new)).worker_id for _ in range(2)] == [0, 1]


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
    aff, rr = affinity_for(0, 1), RoundRobin()
    aff.record(0, DOC)
    assert [rr.pick([W(0), W(1)], lambda w: aff.cached(w.worker_id, DOC)).worker_id for _ in range(2)] == [0, 1]


def test_the_record_forgets_a_prompts_tail_before_its_head_as_the_worker_does():
    """The worker frees a finished sequence's blocks tail first (worker/blocks.py), so when newer
    prompts push it out its prefix is what stays cached: the router's record keeps the same part."""
    aff, ll = affinity_for(0, 1, capacity=50), LeastLoaded()
    aff.record(0, DOC)  # 40 blocks on worker 0
    aff.record(0, list(range(5000, 5000 + 16 * 20)))  # 20 more: 10 of the document's blocks go
    assert aff.cached(0, DOC) == (0.75, 30)  # its first 30 blocks, as worker 0's cache holds them
    ll.took(W(0))  # rotation alone would pick worker 1 next
    assert ll.pick([W(0), W(1)], lambda w: aff.cached(w.worker_id, DOC)).worker_id == 0
