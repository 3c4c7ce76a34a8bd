"""tests/helpers/xdist_groups.py: which modules share a pytest-xdist worker, and their order."""

from __future__ import annotations

from tests.helpers.xdist_groups import OWN_DEPLOYMENTS, group_order, last_users, module_groups, own_name


def test_modules_joined_through_a_session_fixture_share_one_group_e2e_deployments_of_their_own_another():
    uses = {
        "tests/e2e/test_pages.py": {"deployment", "keyed_session"},
        "tests/e2e/test_security.py": {"keyed_session"},
        "tests/e2e/test_echo.py": {"deployment"},
        "tests/e2e/test_batching.py": {"curve_busy"},
        "tests/e2e/test_zmq_curve.py": {"curve_busy"},
        "tests/e2e/test_hold.py": set(),
        "tests/unit/test_plan.py": set(),
    }
    assert module_groups(uses) == {
        "tests/e2e/test_pages.py": "deployment+keyed_session",
        "tests/e2e/test_security.py": "deployment+keyed_session",
        "tests/e2e/test_echo.py": "deployment+keyed_session",
        "tests/e2e/test_batching.py": OWN_DEPLOYMENTS,  # its own, and curve_busy
        "tests/e2e/test_zmq_curve.py": OWN_DEPLOYMENTS,
        "tests/e2e/test_hold.py": OWN_DEPLOYMENTS,
        "tests/unit/test_plan.py": "unit/test_plan",
    }
    assert module_groups({"tests/integration/test_engine.py": {"loaded"}, "tests/ray/test_ray.py": set()}) == {
        "tests/integration/test_engine.py": "loaded",
        "tests/ray/test_ray.py": "ray/test_ray",
    }


def test_a_module_bridging_two_groups_seen_last_joins_them():
    uses = {"a.py": {"x"}, "b.py": {"y"}, "c.py": {"x", "y"}, "d.py": {"z"}}
    assert module_groups(uses) == {"a.py": "x+y", "b.py": "x+y", "c.py": "x+y", "d.py": "z"}


def test_e2e_first_shared_groups_before_own_unit_last():
    modules = [
        ("tests/unit/test_plan.py", "unit/test_plan"),
        ("tests/integration/test_engine.py", "loaded"),
        ("tests/e2e/test_hold.py", "e2e/test_hold"),
        ("tests/ray/test_ray_backend.py", "ray/test_ray_backend"),
        ("tests/e2e/test_echo.py", "deployment"),
        ("tests/integration/test_doctor.py", "integration/test_doctor"),
    ]
    ordered = [m for m, _ in sorted(modules, key=lambda mg: group_order(*mg, on_session_fixture=mg[1] == "loaded"))]
    assert ordered == [
        "tests/e2e/test_echo.py",
        "tests/e2e/test_hold.py",
        "tests/ray/test_ray_backend.py",
        "tests/integration/test_engine.py",
        "tests/integration/test_doctor.py",
        "tests/unit/test_plan.py",
    ]
    assert own_name("tests/e2e/test_hold.py") == "e2e/test_hold"


def test_inside_a_group_the_modules_on_a_session_fixture_come_first():
    own = [
        ("tests/e2e/test_apply.py", False),
        ("tests/e2e/test_batching.py", True),
        ("tests/e2e/test_hold.py", False),
        ("tests/e2e/test_zmq_curve.py", True),
    ]
    ordered = [m for m, on in sorted(own, key=lambda mo: group_order(mo[0], OWN_DEPLOYMENTS, mo[1]))]
    assert ordered == [
        "tests/e2e/test_batching.py",
        "tests/e2e/test_zmq_curve.py",
        "tests/e2e/test_apply.py",
        "tests/e2e/test_hold.py",
    ]


def test_a_session_fixture_is_released_after_its_last_user_in_run_order():
    order = [
        ("batching::a", {"curve_busy"}),
        ("zmq_curve::b", {"curve_busy"}),
        ("apply::c", set()),
        ("echo::d", {"deployment", "keyed_session"}),
        ("echo::e", {"deployment"}),
    ]
    assert last_users(order) == {
        "zmq_curve::b": {"curve_busy"},
        "echo::d": {"keyed_session"},
        "echo::e": {"deployment"},
    }
    assert last_users([("a", set())]) == {}
