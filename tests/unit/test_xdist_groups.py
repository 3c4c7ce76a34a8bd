"""tests/helpers/xdist_groups.py: which modules share a pytest-xdist worker, and their order."""

from __future__ import annotations

from tests.helpers.xdist_groups import group_order, module_groups, own_name


def test_modules_joined_through_a_session_fixture_share_one_group():
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
        "tests/e2e/test_batching.py": "curve_busy",
        "tests/e2e/test_zmq_curve.py": "curve_busy",
        "tests/e2e/test_hold.py": "e2e/test_hold",
        "tests/unit/test_plan.py": "unit/test_plan",
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
    ordered = [m for m, _ in sorted(modules, key=lambda mg: group_order(*mg))]
    assert ordered == [
        "tests/e2e/test_echo.py",
        "tests/e2e/test_hold.py",
        "tests/ray/test_ray_backend.py",
        "tests/integration/test_engine.py",
        "tests/integration/test_doctor.py",
        "tests/unit/test_plan.py",
    ]
    assert own_name("tests/e2e/test_hold.py") == "e2e/test_hold"
