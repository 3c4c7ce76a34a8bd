from dataclasses import dataclass

from router.policies import LeastLoaded, RoundRobin, make_policy


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
